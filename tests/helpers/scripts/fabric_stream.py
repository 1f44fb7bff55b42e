"""A LitGPT-style Fabric loop over a stream, saved mid-epoch with FabricRNGState and resumed (forked ranks).

python fabric_stream.py OUT K SOURCES   # per source (plain,litdata): the whole run, fabric.save after every step
                                        # (OUT/SOURCE/straight/step=J.ckpt), then, in the same processes, a new model
                                        # and loader resumed from step K (OUT/SOURCE/chain/r1)

Sources: plain (stream_run's generator, replayed), litdata (a StreamingDataLoader). Environment: WORKERS, EPOCHS,
DEVICES (2, or 4: more than two ranks), LITDATA_DIR. Rank 0 writes OUT/result.json: the sample ids of every step on
every rank, the synced loss, and fingerprints of the final parameters and optimizer state.
"""

import json
import os
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning as L  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_determinism import DeterministicFabricDDPStrategy, FabricRNGState, fingerprint  # noqa: E402

SOURCE = os.environ.get("SOURCE", "plain")
WORKERS = int(os.environ.get("WORKERS", "2"))
EPOCHS = int(os.environ.get("EPOCHS", "2"))
DEVICES = int(os.environ.get("DEVICES", "2"))


def main(root: Path, k: int, sources: list[str]) -> None:
    # Forked ranks: popen ranks would each import torch and Lightning (~5 s of CPU); the popen launcher's own tests
    # are tests/strategies/test_launchers.py and examples/fabric_tiny_lm.py's.
    strategy = DeterministicFabricDDPStrategy(seed=11, start_method="fork")
    L.Fabric(accelerator="cpu", devices=DEVICES, strategy=strategy).launch(ranks, root, k, sources)


def ranks(fabric: L.Fabric, root: Path, k: int, sources: list[str]) -> None:
    global SOURCE
    for SOURCE in sources:
        run(fabric, root / SOURCE / "straight", None)
        run(fabric, root / SOURCE / "chain" / "r1", root / SOURCE / "straight" / f"step={k}.ckpt")


def run(fabric: L.Fabric, out: Path, ckpt: Path | None) -> None:
    import stream_run  # the sources of the Trainer's tests

    if SOURCE == "litdata" and fabric.global_rank == 0 and not Path(os.environ["LITDATA_DIR"]).exists():
        stream_run.write_litdata(Path(os.environ["LITDATA_DIR"]))
    fabric.barrier()
    stream_run.configure({"source": SOURCE, "workers": WORKERS})

    out.mkdir(parents=True, exist_ok=True)
    if SOURCE == "litdata":
        loader = stream_run.litdata_loader()
    else:
        loader = DataLoader(stream_run.Shuffled(), batch_size=4, num_workers=WORKERS)
    loader = fabric.setup_dataloaders(loader, move_to_device=False)
    with fabric.init_module():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))
    model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    state = {"model": model, "optimizer": optimizer, "rng": FabricRNGState(loader), "step": 0, "epoch": 0}
    if ckpt is not None:
        fabric.load(ckpt, state)
    steps = {}
    while state["epoch"] < EPOCHS:
        for batch in loader:  # after a mid-epoch load, the interrupted epoch continues at the next sample
            loss = model(batch["x"].float()).square().mean()
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            state["step"] += 1
            ids = fabric.all_gather(batch["id"].reshape(-1).long())
            synced = fabric.all_reduce(loss.detach(), reduce_op="mean")
            steps[state["step"]] = {"ids": ids.tolist(), "loss": float(synced).hex()}
            fabric.save(out / f"step={state['step']}.ckpt", state)
        state["epoch"] += 1
    fabric.barrier()
    if fabric.global_rank == 0:
        result = {
            "params": fingerprint(model),
            "optimizer": fingerprint(optimizer),
            "global_step": state["step"],
            "steps": steps,
        }
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(","))
