"""DivergenceProbe: record where a Trainer run's bits come from, module by module, for its first (or given) steps.

The Trainer's form of :class:`~lightning_determinism.divergence.diagnosis.recorder.ProbeRecorder` (see there for what is
recorded and :mod:`~lightning_determinism.divergence.diagnosis.probe_file` for the file). Two runs' files go to
:func:`~lightning_determinism.diagnose` or ``lightning-determinism diagnose A.json B.json``, which names the first
step, micro-batch, module and phase that produced other bits, and why.

Where the Trainer's hooks fall: ``on_train_batch_start`` takes the batch and the random states (and installs the
module hooks), ``on_before_backward`` the loss (Lightning divided it by ``accumulate_grad_batches``: the probe scales
backward digests back), ``on_after_backward`` ends the micro-batch, ``on_before_optimizer_step`` takes the reduced
gradients (after DDP's all-reduce or the invariant mode's tree, before clipping), and the ``on_train_batch_end`` of
the batch that completed a step takes the parameters and optimizer states.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_determinism.divergence.diagnosis.recorder import ProbeRecorder
from lightning_determinism.errors import DeterminismWarning


def _loader_generators(trainer: pl.Trainer) -> dict[str, torch.Generator]:
    """The training loaders' generators (their own and their samplers'), by name."""
    loaders = trainer.train_dataloader
    if isinstance(loaders, dict):
        loaders = list(loaders.values())
    elif not isinstance(loaders, (list, tuple)):
        loaders = [loaders]
    out: dict[str, torch.Generator] = {}
    for i, loader in enumerate(loaders):
        for where, owner in (("loader", loader), ("sampler", getattr(loader, "sampler", None))):
            gen = getattr(owner, "generator", None)
            if isinstance(gen, torch.Generator):
                out[f"{where}[{i}]"] = gen
    return out


class DivergenceProbe(ProbeRecorder, Callback):
    """Record the given optimizer steps of a Trainer run, module by module, into ``path`` (written by rank 0).

    Args:
        path: the JSON file rank 0 writes.
        steps: an int ``n`` (the first ``n`` optimizer steps, counted from 0) or a list of steps
            (``trainer.global_step`` values: a resumed run records the listed steps after its checkpoint).
        modules: the module paths to hook, as ``named_modules()`` names them; ``None`` hooks every submodule (the
            LightningModule itself, ``""``, only when named: its ``forward`` is ``training_step`` under DDP).
        record_ops: log the torch functions each module call runs.

    In world-size-invariant mode (``global_batch_size`` and ``micro_batch_size`` on the strategy) micro-batch ``j`` of
    a step is the same computation on any world size, so a 1-process and a 4-process run line up record by record.
    Outside the recorded steps the model carries no hook.

    Examples:
        >>> probe = DivergenceProbe("probe.json", steps=[3, 4])
        >>> probe.steps, probe.recording(2), probe.recording(3)
        ((3, 4), False, True)
    """

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            rank_zero_warn(
                f"DivergenceProbe records training steps: Trainer.{getattr(stage, 'value', stage)}()"
                f" records none and writes no probe file",
                category=DeterminismWarning,
            )
            return
        invariant = getattr(trainer.strategy, "invariant", None)
        if invariant is not None:
            self.invariant = {
                "global_batch_size": invariant.global_batch_size,
                "micro_batch_size": invariant.micro_batch_size,
            }

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.recording(trainer.global_step):
            generators = _loader_generators(trainer)
            self.before_micro_batch(pl_module, batch, trainer.global_step, trainer.optimizers, generators)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        accumulation = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
        self.before_backward(loss, accumulation)

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.after_backward()

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self.before_optimizer_step(pl_module)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = self._step
        if step is not None and "reduced" in step and trainer.global_step > step["step"]:  # this batch ended a step
            self.after_optimizer_step(pl_module, trainer.optimizers)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.finish()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._hooks is not None:
            self._hooks.remove()  # a failed fit leaves the model unhooked; nothing is written


__all__ = ["DivergenceProbe"]
