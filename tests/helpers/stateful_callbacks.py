"""Runs with Lightning's stateful callbacks, uninterrupted, interrupted after a checkpoint and resumed from it.

A run's directory holds what the tests compare: ``log-rank<r>.jsonl`` (every value logged, appended by the interrupted
run and then the resumed one, as a job's log would be), ``topk/`` (``ModelCheckpoint(save_top_k=2)``'s files) and
``result-rank<r>.pt`` (the final weights, learning rates, callback states and epochs). Importable: spawned ranks
unpickle the module and callbacks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import (
    Checkpoint,
    EarlyStopping,
    LearningRateMonitor,
    ModelCheckpoint,
    StochasticWeightAveraging,
)
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

SEED = 7
BATCHES = 4  # per epoch and rank
# The checkpoints resumed: in the middle of an epoch (SWA's: epoch 2, after SWALR took over the lr; the plateau's:
# epoch 1), and after epoch 1's last batch.
STEPS = {"swa": {"mid-epoch": 10, "last-batch": 8}, "plateau": {"mid-epoch": 6, "last-batch": 8}}
# More places Lightning's restart skips something, with ReduceLROnPlateau: a checkpoint after a batch at which
# validation was due (val_check_interval=2); one written at the end of epoch 1's validation pass, one in its
# on_train_epoch_end (the plateau step comes after both). Name: (checkpoint, step, where it is written).
MORE = {
    "validation-due": ("steps/step=6.ckpt", 6, "on_train_batch_end"),
    "validation-end": ("val/epoch=1-step=8.ckpt", 8, "on_validation_end"),
    "epoch-end": ("epochs/epoch=1-step=8.ckpt", 8, "on_train_epoch_end"),
}
# Added to the validation loss per epoch: ReduceLROnPlateau halves the lr after epochs 2 and 3 (0.1 -> 0.025),
# EarlyStopping(patience=2) stops after epoch 3, whatever the weights' own loss (well under 1).
OFFSETS = [10.0, 0.0, 5.0, 10.0, 15.0, 20.0]


class Interrupted(Exception):
    """Ends a run right after the checkpoint of a given step, as a killed job would end."""


class Interrupt(Checkpoint):
    """Raises after every ModelCheckpoint wrote its checkpoint of step ``at`` (checkpoint callbacks run last).

    ``hook``: where that checkpoint is written, ``on_train_batch_end``, ``on_validation_end`` or ``on_train_epoch_end``.
    """

    def __init__(self, at: int, hook: str = "on_train_batch_end") -> None:
        self.at, self.hook = at, hook

    def _stop(self, trainer: L.Trainer, hook: str) -> None:
        if trainer.global_step == self.at and hook == self.hook:
            raise Interrupted(f"interrupted after step {self.at}, in {hook}")

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._stop(trainer, "on_train_batch_end")

    def on_validation_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._stop(trainer, "on_validation_end")

    def on_train_epoch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._stop(trainer, "on_train_epoch_end")


class EpochScale(L.Callback):
    """A user's callback keeping state in ``on_train_epoch_start/end``.

    It sets a loss scale that no checkpoint holds (the module reads it in every step) and keeps a history of what it
    saw, which it saves (``state_dict``).
    """

    def __init__(self) -> None:
        self.history: list[list[Any]] = []

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.loss_scale = 1.0 / (1 + trainer.current_epoch)
        self.history.append(["start", trainer.current_epoch, trainer.global_step, _lr(trainer)])

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.history.append(["end", trainer.current_epoch, trainer.global_step, _lr(trainer)])

    def state_dict(self) -> dict[str, Any]:
        return {"history": [list(entry) for entry in self.history]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = [list(entry) for entry in state_dict["history"]]


class RandomScale(L.Callback):
    """Draws the loss scale at each epoch's start: a replayed hook that cannot draw the same number (warned)."""

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.loss_scale = float(torch.rand(1)) + 0.5


def _points(n: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 4, generator=gen), torch.randn(n, 1, generator=gen))


def _lr(trainer: L.Trainer) -> float:
    return float(trainer.optimizers[0].param_groups[0]["lr"])


class LineLogger(Logger):
    """Appends every ``log_metrics`` call, on every rank, to ``log-rank<r>.jsonl`` (floats as hex: bitwise)."""

    def __init__(self, root: str) -> None:
        super().__init__()
        self.root = root

    @property
    def name(self) -> str:
        return "lines"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        entry = {"step": step, **{key: float(value).hex() for key, value in sorted(metrics.items())}}
        with open(Path(self.root) / f"log-rank{rank}.jsonl", "a") as file:
            file.write(json.dumps(entry) + "\n")


class PlateauNet(L.LightningModule):
    """Dropout, shuffled data, SGD; ``plateau``: with ReduceLROnPlateau on ``val_loss``."""

    def __init__(self, root: str, world_size: int, plateau: bool, log_train: bool = False) -> None:
        super().__init__()
        self.root, self.world_size, self.plateau, self.log_train = root, world_size, plateau, log_train
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(0.25), nn.Linear(8, 1))
        self.loss_scale = 1.0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y) * self.loss_scale
        if self.log_train:  # an epoch-level value: an interrupted epoch's aggregate is lost at a resume (warned)
            self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y) + OFFSETS[self.current_epoch]
        self.log("val_loss", loss, sync_dist=True)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_points(4 * BATCHES * self.world_size, seed=0), batch_size=4, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_points(8 * self.world_size, seed=1), batch_size=4)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        if not self.plateau:
            return optimizer
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss"}}

    def on_fit_end(self) -> None:
        swa = next((cb for cb in self.trainer.callbacks if isinstance(cb, StochasticWeightAveraging)), None)
        scale = next(cb for cb in self.trainer.callbacks if isinstance(cb, EpochScale))
        result = {
            "params": {name: p.detach().clone() for name, p in self.net.state_dict().items()},
            "lr": _lr(self.trainer),
            "epochs": int(self.trainer.current_epoch),
            "global_step": int(self.trainer.global_step),
            "history": scale.history,
            "n_averaged": None if swa is None or swa.n_averaged is None else int(swa.n_averaged),
        }
        torch.save(result, Path(self.root) / f"result-rank{self.global_rank}.pt")


def callbacks(root: Path, config: str, interrupt_at: int | None, hook: str = "on_train_batch_end") -> list[Any]:
    """``"swa"``: SWA, EarlyStopping and ModelCheckpoint(save_top_k=2); ``"plateau"``: for ReduceLROnPlateau.

    Both: a ModelCheckpoint after every step (the checkpoints resumed), LearningRateMonitor and :class:`EpochScale`;
    with ``hook`` another than ``on_train_batch_end``, a ModelCheckpoint that saves there too.
    """
    chosen: list[Any] = [
        EpochScale(),
        LearningRateMonitor(logging_interval="epoch"),
        ModelCheckpoint(dirpath=root / "steps", filename="{step}", every_n_train_steps=1, save_top_k=-1),
    ]
    if hook != "on_train_batch_end":  # at each epoch's end, or at the end of each validation pass
        epoch_end = hook == "on_train_epoch_end"
        chosen.append(ModelCheckpoint(dirpath=root / ("epochs" if epoch_end else "val"), filename="{epoch}-{step}",
                                      save_on_train_epoch_end=epoch_end, save_top_k=-1))  # fmt: skip
    if config == "swa":
        chosen += [
            StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=2, annealing_epochs=2),
            EarlyStopping(monitor="val_loss", patience=1),
            ModelCheckpoint(dirpath=root / "topk", filename="{epoch}-{step}", monitor="val_loss", save_top_k=2),
        ]
    if interrupt_at is not None:
        chosen.append(Interrupt(interrupt_at, hook))
    return chosen


def fit(root: Path, config: str, strategy: Any, devices: int, ckpt: Path | None = None, stop: int | None = None,
        hook: str = "on_train_batch_end", log_train: bool = False, extra: tuple[Any, ...] = (),
        **trainer_kwargs: Any) -> None:  # fmt: skip
    """One fit in ``root`` (5 epochs at most); ``stop``: interrupted after that step's checkpoint; ``extra``: more
    callbacks."""
    root.mkdir(parents=True, exist_ok=True)
    L.seed_everything(SEED, verbose=False)  # the weights, built in __init__ (SWA copies the module in its setup)
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, callbacks=[*callbacks(root, config, stop, hook), *extra],
        logger=LineLogger(str(root)), log_every_n_steps=1000, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, **{"max_epochs": len(OFFSETS) - 1, **trainer_kwargs},
    )  # fmt: skip
    model = PlateauNet(str(root), devices, plateau=config == "plateau", log_train=log_train)
    try:
        trainer.fit(model, ckpt_path=ckpt)
    except Exception as error:  # the interrupted run: a rank's Interrupted, as the launcher reports it
        if stop is None or "interrupted after step" not in repr(error) + str(getattr(error, "__cause__", "")):
            raise


def run_all(root: Path, config: str, make_strategy: Any, devices: int) -> None:
    """The uninterrupted run in ``root/straight``; for each of :data:`STEPS`, interrupted then resumed in one dir."""
    fit(root / "straight", config, make_strategy(), devices)
    for name, step in STEPS[config].items():
        where = root / name
        fit(where, config, make_strategy(), devices, stop=step)
        fit(where, config, make_strategy(), devices, ckpt=where / "steps" / f"step={step}.ckpt")


def run_more(root: Path, make_strategy: Any, devices: int) -> None:
    """:data:`MORE`'s cases with ReduceLROnPlateau, each with its own uninterrupted run (``root/<case>/straight``)."""
    for name, (checkpoint, step, hook) in MORE.items():
        options: dict[str, Any] = {"hook": hook}
        if name == "validation-due":
            options["val_check_interval"] = 2
        fit(root / name / "straight", "plateau", make_strategy(), devices, **options)
        where = root / name / "resumed"
        fit(where, "plateau", make_strategy(), devices, stop=step, **options)
        fit(where, "plateau", make_strategy(), devices, ckpt=where / checkpoint, **options)


def read(root: Path, devices: int) -> dict[int, Any]:
    """Per rank: the final result and the lines logged; ``topk``: ModelCheckpoint(save_top_k=2)'s files (rank 0)."""
    topk = sorted(os.listdir(root / "topk")) if (root / "topk").is_dir() else []
    return {
        rank: {
            **torch.load(root / f"result-rank{rank}.pt", weights_only=True),
            "log": (root / f"log-rank{rank}.jsonl").read_text().splitlines(),
            "topk": topk,
        }
        for rank in range(devices)
    }
