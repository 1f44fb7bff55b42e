"""NumericalBaseline: record the first steps of a Trainer run, or check a run against such a record.

The Trainer's form of :class:`~lightning_determinism.baseline_recorder.BaselineRecorder` (see there for the method
and the file format): gradient norms are taken after DDP's all-reduce, just before the optimizer step; the loss,
parameter norms and fingerprints just after it.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_determinism.baseline_recorder import BaselineMismatch, BaselineRecorder


class NumericalBaseline(BaselineRecorder, Callback):
    """Record the first ``steps`` optimizer steps into ``path``, or compare a run against that record.

    Args:
        path: the JSON file (written by rank 0 in ``"record"`` mode, read in ``"compare"`` mode).
        steps: how many steps to record or compare.
        mode: ``"record"`` or ``"compare"``.
        rtol: relative tolerance for ``"compare"`` (default ``1e-4``, see docs/divergence.md).
        atol: absolute tolerance for ``"compare"`` (default ``1e-6``).
        on_mismatch: ``"raise"`` (:class:`BaselineMismatch`) or ``"warn"`` (a ``DeterminismWarning``, once).
        nonfinite_equal: count identical NaN/``inf`` values on both sides as equal (by default a non-finite value
            is always a mismatch).

    In ``"compare"`` mode a run that matches says so once, on rank 0: how many steps and quantities matched within
    which tolerance.

    Examples:
        >>> NumericalBaseline("baseline.json", steps=3, mode="record").steps
        3
    """

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.start()

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self.before_optimizer_step(pl_module)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.recording or not self._current:
            return
        self.after_optimizer_step(pl_module, outputs["loss"] if isinstance(outputs, dict) else outputs)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.finish()


__all__ = ["BaselineMismatch", "NumericalBaseline"]
