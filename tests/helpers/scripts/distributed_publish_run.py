"""Distributed checkpoint saves killed, mixed and resumed under DeterministicModelParallelStrategy (FSDP2, 2 ranks).

python distributed_publish_run.py OUT PHASE

PHASE (each its own process; every rank writes OUT/<phase>/rank<r>.json: the step and the gathered weights' digest
at the start of training, the digest after every step, written as it goes):
- ``straight``: 6 steps, ``ModelCheckpoint(save_last=True, every_n_train_steps=2)`` and ``step=K.ckpt`` directories;
- ``resumed``: from OUT/straight/step=2.ckpt;
- ``killed``: 6 steps saving only ``last.ckpt/`` every 2 steps; at the step-4 save, once DCP's save has returned on
  rank 0 (every shard and the index written, ``meta.pt`` not yet), rank 0 SIGKILLs itself: the hand-shake is DCP
  returning, nothing waits on a clock;
- ``killed-resumed``: ``ckpt_path="last"`` in the killed run's directory;
- ``mixed-last``: ``ckpt_path="last"`` in OUT/mixed/, a copy the test mixed from two saves.
"""

import json
import os
import signal
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import lightning as L  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_determinism import DeterministicModelParallelStrategy  # noqa: E402

SEED = 5


def digest(module: nn.Module) -> str:
    import hashlib

    from torch.distributed.tensor import DTensor

    h = hashlib.sha256()
    for name, value in sorted(module.state_dict().items()):
        tensor = value.full_tensor() if isinstance(value, DTensor) else value
        h.update(name.encode())
        h.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Net(L.LightningModule):
    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out
        self.model: nn.Module | None = None
        self.record: dict = {"steps": {}}

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from torch.distributed._composable.fsdp import fully_shard

        self.model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        fully_shard(self.model, mesh=self.device_mesh["data_parallel"])

    def _write(self) -> None:
        (self.out / f"rank{self.global_rank}.json").write_text(json.dumps(self.record))

    def on_train_start(self) -> None:
        self.record["start"] = {"step": int(self.trainer.global_step), "digest": digest(self.model)}
        self._write()

    def training_step(self, batch, batch_idx):
        return self.model(batch[0]).square().mean()

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.record["steps"][int(self.trainer.global_step)] = digest(self.model)
        self._write()

    def train_dataloader(self):
        x = torch.randn(24, 4, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x), batch_size=2)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def kill_rank_zero_after_the_shards_of(step: int) -> None:
    """Rank 0 dies by SIGKILL when DCP's save of ``step`` returns: every shard written, nothing after them."""
    save = dcp.save

    def save_then_die(state, *args, **kwargs):
        result = save(state, *args, **kwargs)
        if torch.distributed.get_rank() == 0 and SAVING["step"] == step:
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    dcp.save = save_then_die


SAVING = {"step": -1}


class StepOfTheSave(L.Callback):
    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        SAVING["step"] = int(checkpoint["global_step"])


def fit(out: Path, ckpt: Path | str | None, callbacks: list) -> None:
    out.mkdir(parents=True, exist_ok=True)
    strategy = DeterministicModelParallelStrategy(seed=SEED, data_parallel_size=2, tensor_parallel_size=1,
                                                  start_method="fork")  # fmt: skip
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_steps=6, callbacks=[StepOfTheSave(), *callbacks],
        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        default_root_dir=str(out),
    )  # fmt: skip
    trainer.fit(Net(out), ckpt_path=str(ckpt) if ckpt else None)


def last_only(directory: Path) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=directory, save_last=True, save_top_k=0, every_n_train_steps=2)


if __name__ == "__main__":
    root, phase = Path(sys.argv[1]), sys.argv[2]
    out = root / phase
    if phase == "straight":
        every = ModelCheckpoint(dirpath=out, save_last=True, save_top_k=-1, every_n_train_steps=2, filename="{step}")
        fit(out, None, [every])
    elif phase == "resumed":
        fit(out, root / "straight" / "step=2.ckpt", [])
    elif phase == "killed":
        kill_rank_zero_after_the_shards_of(4)
        fit(out, None, [last_only(out)])
    elif phase == "killed-resumed":
        fit(out, "last", [last_only(root / "killed")])
    elif phase == "mixed-last":
        fit(out, "last", [last_only(root / "mixed")])
    else:
        raise SystemExit(f"unknown phase {phase!r}")
