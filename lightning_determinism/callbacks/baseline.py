"""NumericalBaseline: record the first steps of a Trainer run, or check a run against such a record.

The Trainer's form of :class:`~lightning_determinism.divergence.baseline_recorder.BaselineRecorder` (see there for the
method and the file format): gradient norms are taken after DDP's all-reduce, just before the optimizer step; parameter
norms and digests just after it; a step begins at its first batch (for its peak memory and communication time). The
run's strategy, launcher, precision and device mesh go into the file's ``"run"`` entry. The loss of a step is the
mean of the losses of all its micro-batches (every batch of the accumulation window) on all ranks, from exact sums:
the same bits on any world size when the micro-batch losses are the same.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_determinism._compat.access import device_mesh_of, launcher_start_method
from lightning_determinism._compat.checks import MultiProcessingLauncher
from lightning_determinism.divergence.baseline_recorder import BaselineMismatch, BaselineRecorder
from lightning_determinism.divergence.run_metadata import mesh_description
from lightning_determinism.errors import DeterminismWarning


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
        comm_every: in ``"record"`` mode, profile the communication of one step in ``comm_every`` (0: never).

    In ``"compare"`` mode a run that matches says so once, on rank 0: how many steps and quantities matched within
    which tolerance.

    Examples:
        >>> NumericalBaseline("baseline.json", steps=3, mode="record").steps
        3
    """

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            rank_zero_warn(
                f"NumericalBaseline records training steps: Trainer.{getattr(stage, 'value', stage)}()"
                f" records none and writes no baseline"
                " (the determinism record in the logger holds the evaluated weights' fingerprint)",
                category=DeterminismWarning,
            )
            return
        self.start()
        strategy = trainer.strategy
        launcher = strategy.launcher
        start_method: str | None
        if isinstance(launcher, MultiProcessingLauncher):
            start_method = launcher_start_method(launcher)
        else:
            start_method = getattr(strategy, "start_method", None)  # the model-parallel strategy's own argument
        self.set_run(
            strategy=type(strategy).__name__,
            launcher=None
            if launcher is None
            else type(launcher).__name__ + (f" ({start_method})" if start_method else ""),
            precision=str(trainer.precision),
        )

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self.recording:
            return
        if "mesh" not in self.run_info:
            self.set_run(mesh=mesh_description(device_mesh_of(trainer.strategy)))
        self.record_batch(batch)
        self.begin_step(pl_module)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self.before_optimizer_step(pl_module)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.recording:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            # Lightning divides the loss by `accumulate_grad_batches` (exact for the powers of two that invariant
            # mode uses); the step's loss is the mean of the undivided micro-batch losses on all ranks. A float64
            # product in Python: the bits of torch's, without two operations on the tensor.
            self.add_loss(float(loss.detach()) * trainer.accumulate_grad_batches)
        elif isinstance(loss, torch.Tensor):
            self.add_loss(loss.detach().double() * trainer.accumulate_grad_batches)
        if self._current:  # this batch completed an optimizer step
            self.after_optimizer_step(pl_module)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.finish()


__all__ = ["BaselineMismatch", "NumericalBaseline"]
