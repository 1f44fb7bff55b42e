"""``ModelCheckpoint`` saves after optimizer steps only: never in the middle of an accumulation window.

Installed by :class:`~lightning_determinism.RNGStateCheckpoint` on every ``ModelCheckpoint`` of the trainer.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_determinism._compat.access import should_accumulate


class AfterOptimizerSteps:
    """``ModelCheckpoint.on_train_batch_end`` that does nothing on a micro-batch that only accumulates gradients.

    ``ModelCheckpoint(every_n_train_steps=k)`` saves after a batch when ``global_step % k == 0`` and that step was not
    saved yet. A resumed run does not know the step it resumed was saved, and with ``accumulate_grad_batches > 1`` its
    first micro-batches leave ``global_step`` unchanged: stock Lightning writes ``step=k.ckpt`` again there, with a
    half-accumulated step and no gradients (the run resumed from it is not the uninterrupted one). A time-based
    ``train_time_interval`` can fall inside a window the same way. Deferred to the window's last micro-batch, every
    save is at an optimizer step, as in the uninterrupted run.
    """

    def __init__(self, callback: ModelCheckpoint) -> None:
        self.callback = callback  # the class's hook is called: the instance attribute is this object

    def __call__(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        if trainer.accumulate_grad_batches > 1 and should_accumulate(trainer):
            return
        type(self.callback).on_train_batch_end(self.callback, trainer, *args, **kwargs)


def save_at_step_boundaries(callback: ModelCheckpoint) -> None:
    """Have ``callback`` save after optimizer steps only (see :class:`AfterOptimizerSteps`); once."""
    if not isinstance(callback.__dict__.get("on_train_batch_end"), AfterOptimizerSteps):
        callback.on_train_batch_end = AfterOptimizerSteps(callback)  # type: ignore[method-assign]


__all__ = ["AfterOptimizerSteps", "save_at_step_boundaries"]
