"""Runs of the deterministic ModelParallelStrategy (tensor parallel, FSDP2, both) on forked gloo ranks.

python model_parallel_run.py OUT JSON    # JSON: a list of configs {"name", "dp", "tp", "resume": [K...], "twice"}

Per config: the straight run (2 epochs of 16 samples, a checkpoint every 5 steps: Lightning's distributed checkpoint
directories), then a run resumed from each step K, in this process (new forked ranks each time). Every rank writes
OUT/<name>/<run>/rank<r>.json: per step the draws of the default stream and of the tracker's fork, the loss, the
digests of the tensors the tensor-parallel dimension replicates, and at the start the digest of the gathered model;
at the end the fingerprint of the gathered model. The straight run logs the determinism record to a CSVLogger
(OUT/<name>/straight/logs/version_0/hparams.yaml). OUT/<name>/one_process.json: the model one process builds under the
same base seed, for comparison with the gathered start.
"""

import contextlib
import hashlib
import json
import os
import signal
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_determinism import (  # noqa: E402
    DeterministicModelParallelStrategy,
    DivergenceProbe,
    PreemptionCheckpoint,
    ReplicaGuard,
    fingerprint,
    get_rng_tracker,
)
from lightning_determinism.callbacks.replica_guard import replicated_digests  # noqa: E402

SEED = 23
GUARD = os.environ.get("GUARD")  # "off": the mixin's old rule (base + rank), for the replica guard's test
CHECKPOINTED = False  # the forward under activation checkpointing: the recipe's order, tensor parallel -> AC -> FSDP2


class TPNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        if CHECKPOINTED:  # recomputed in the backward: the fork's dropout must draw the forward's mask again
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)

    def _forward(self, x):
        h = torch.relu(self.up(x))  # column-parallel: each tensor-parallel rank holds a shard of the features
        with get_rng_tracker().fork():  # dropout on the shard: each rank its own stream
            h = nn.functional.dropout(h, 0.3)
        h = self.down(h)  # row-parallel: replicated output
        h = nn.functional.dropout(h, 0.3)  # dropout on a replicated activation: the default stream
        return self.head(self.norm(h))


def gathered(module: nn.Module) -> dict:
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach() for k, v in module.state_dict().items()}


def digest(state: dict) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(state.items()):
        h.update(name.encode())
        h.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Net(L.LightningModule):
    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out
        self.model = None
        self.record: dict = {"steps": {}}
        self.preempt_at: int | None = None  # the step during which every rank gets SIGTERM

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from torch.distributed._composable.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        self.model = TPNet()  # under the base seed on every rank
        self.record["built"] = digest({k: v.detach() for k, v in self.model.state_dict().items()})
        tp, dp = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        if tp.size() > 1:
            parallelize_module(self.model, tp, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        if dp.size() > 1:
            fully_shard(self.model, mesh=dp)

    def on_train_start(self) -> None:
        from lightning_determinism.parallel import dtensor_random

        self.record["start"] = digest(gathered(self.model))
        self.record["dtensor_routed"] = dtensor_random.installed()

    def training_step(self, batch, batch_idx):
        if self.preempt_at is not None and self.trainer.global_step + 1 == self.preempt_at:
            os.kill(os.getpid(), signal.SIGTERM)  # every rank, as a scheduler signals the whole job
        draws = {"default": torch.rand(3).tolist()}
        with get_rng_tracker().fork():
            draws["fork"] = torch.rand(3).tolist()
        loss = self.model(batch[0]).square().mean()
        step = int(self.trainer.global_step) + 1
        self.record["steps"][step] = {
            "draws": draws,
            "loss": float(loss).hex(),
            "x": batch[0].sum().item(),
            "samples": batch[1].tolist(),
        }
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.record["steps"][int(self.trainer.global_step)]["replicated"] = replicated_digests(self.model)

    def train_dataloader(self):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, torch.arange(16)), batch_size=2, shuffle=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def on_train_end(self) -> None:
        self.record["final"] = digest(gathered(self.model))
        # What one process gets for the same weights, named as the LightningModule's state_dict names them.
        self.record["final_fingerprint"] = fingerprint({f"model.{k}": v for k, v in gathered(self.model).items()})
        (self.out / f"rank{self.global_rank}.json").write_text(json.dumps(self.record))


class OldRule(DeterministicModelParallelStrategy):
    """The mixin before it followed the mesh: base + rank everywhere."""

    def _ldet_follow_mesh(self, rank: int, world_size: int) -> None:
        tracker = get_rng_tracker()  # the forward forks it: a stream of its own per rank, as a user would add one
        if "model-parallel-rng" not in tracker:
            tracker.add("model-parallel-rng", SEED + 1 + rank)


def fit(
    out: Path, dp: int, tp: int, ckpt: Path | None = None, every_step: bool = True, preempt_at: int | None = None,
    checkpointed: bool = False, probe: bool = False,
) -> None:  # fmt: skip
    global CHECKPOINTED
    CHECKPOINTED = checkpointed
    out.mkdir(parents=True, exist_ok=True)
    cls = OldRule if GUARD == "off" else DeterministicModelParallelStrategy
    strategy = cls(seed=SEED, data_parallel_size=dp, tensor_parallel_size=tp, start_method="fork")
    callbacks = (
        [ModelCheckpoint(dirpath=out, every_n_train_steps=5, save_top_k=-1, filename="{step}")] if every_step else []
    )
    callbacks.append(ReplicaGuard(every_n_train_steps=1))  # every step: a drift is caught at once
    if preempt_at is not None:
        callbacks.append(PreemptionCheckpoint(dirpath=out))
    if probe:  # the module outputs of a RowwiseParallel layer are AsyncCollectiveTensors: digested, never a crash
        callbacks.append(DivergenceProbe(out / "probe.json", steps=3))
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=dp * tp, max_epochs=2, callbacks=callbacks,
        logger=CSVLogger(out, name="logs", version=0) if every_step and ckpt is None else False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        enable_checkpointing=every_step, default_root_dir=str(out),
    )  # fmt: skip
    net = Net(out)
    net.preempt_at = preempt_at
    trainer.fit(net, ckpt_path=str(ckpt) if ckpt else None)


def one_process(out: Path) -> None:
    from lightning_determinism.divergence.diagnosis.digest import digest as probe_digest

    torch.manual_seed(SEED)  # what configure_model runs under: the base seed
    model = TPNet()
    params = {name: probe_digest(p.detach()) for name, p in model.named_parameters()}  # as the probe records them
    (out / "one_process.json").write_text(json.dumps({"start": digest(gathered(model)), "params": params}))


if __name__ == "__main__":
    out, configs = Path(sys.argv[1]), json.loads(sys.argv[2])
    for config in configs:
        root = out / config["name"]
        root.mkdir(parents=True, exist_ok=True)
        one_process(root)
        fit(root / "straight", config["dp"], config["tp"])
        if config.get("checkpointed"):
            fit(root / "checkpointed", config["dp"], config["tp"], every_step=False, checkpointed=True)
        if config.get("twice"):
            fit(root / "again", config["dp"], config["tp"], every_step=False, probe=True)
        for k, dp, tp in config.get("elastic", []):  # another data-parallel size: DCP reshards, the rest is dealt
            fit(root / f"elastic{k}-{dp}x{tp}", dp, tp, ckpt=root / "straight" / f"step={k}.ckpt", every_step=False)
        for k in config.get("preempt", []):  # SIGTERM in step k: PreemptionCheckpoint writes a distributed one
            with contextlib.suppress(SystemExit):  # the ranks stop cleanly; the launcher says so with SystemExit
                fit(root / f"preempted{k}", config["dp"], config["tp"], every_step=False, preempt_at=k)
            fit(root / f"preempted{k}-resumed", config["dp"], config["tp"], every_step=False,
                ckpt=root / f"preempted{k}" / "preempted.ckpt")  # fmt: skip
        for k in config.get("resume", []):
            fit(root / f"resumed{k}", config["dp"], config["tp"], ckpt=root / "straight" / f"step={k}.ckpt",
                every_step=False)  # fmt: skip
