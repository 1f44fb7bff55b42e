"""Started by torchrun on each 'node': model_parallel_run.py's straight run of one config, every process a rank.

torchrun --nnodes=N --nproc-per-node=P --node-rank=K ... model_parallel_torchrun.py OUT CONFIG [DDP_OUT]

CONFIG: {"name", "dp", "tp"}. With DDP_OUT, the same processes first run a short fit under ``ddp_deterministic``
(tests/lightning_models.RecordingModule, its records in DDP_OUT, the base seed from ``PL_GLOBAL_SEED``): one launch
serves both multi-node tests, as each process spends most of its time importing.

The Trainer of ``model_parallel_run.fit`` without its checkpoints, on ``devices=P, num_nodes=N``: Lightning's
torchelastic environment, so the strategy's ``start_method`` starts nothing. Every rank's global RNG is perturbed by
its rank first, so that only the strategy can make ranks agree. Every rank writes OUT/<name>/rank<r>.json as
model_parallel_run.py does, plus where it ran (node, local rank, mesh coordinate).
"""

import json
import os
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import lightning as L  # noqa: E402

from lightning_determinism import DeterministicModelParallelStrategy, ReplicaGuard  # noqa: E402
from tests.helpers.scripts.model_parallel_run import SEED, Net  # noqa: E402


class PlacedNet(Net):
    """model_parallel_run's module, which also records where its rank runs."""

    def on_train_start(self) -> None:
        super().on_train_start()
        mesh = self.device_mesh.get_coordinate()
        self.record["where"] = {"node": self.trainer.node_rank, "local_rank": self.local_rank, "mesh": mesh}


if __name__ == "__main__":
    config = json.loads(sys.argv[2])
    out = Path(sys.argv[1]) / config["name"]
    out.mkdir(parents=True, exist_ok=True)
    rank, devices = int(os.environ["RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    if len(sys.argv) > 3:  # the DDP fit first, in the same processes
        from tests.helpers.lightning_models import RecordingModule, quiet_trainer

        ddp = quiet_trainer("ddp_deterministic", devices=devices, num_nodes=int(os.environ["WORLD_SIZE"]) // devices,
                            max_epochs=1)  # fmt: skip
        ddp.fit(RecordingModule(sys.argv[3], n=16))
        os.environ.pop("PL_GLOBAL_SEED", None)  # the model-parallel run's seed is its strategy's, as in-process
    torch.manual_seed(1000 + rank)  # what an unseeded rank would start from: different on every rank
    strategy = DeterministicModelParallelStrategy(
        seed=SEED, data_parallel_size=config["dp"], tensor_parallel_size=config["tp"], start_method="fork"
    )
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, num_nodes=int(os.environ["WORLD_SIZE"]) // devices,
        max_epochs=2, callbacks=[ReplicaGuard(every_n_train_steps=1)], logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, enable_checkpointing=False, default_root_dir=str(out),
    )  # fmt: skip
    trainer.fit(PlacedNet(out))
