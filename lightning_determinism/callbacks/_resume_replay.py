"""What Lightning's restart skips on a resumed fit, replayed in the uninterrupted run's order: :class:`ResumeReplay`.

Lightning (2.5, 2.6) restores a checkpoint's loop counters and goes on from there, but leaves out parts of the run
that lie between the checkpoint and the next batch:

- resumed in the middle of an epoch, ``_FitLoop.on_advance_start`` skips the ``on_train_epoch_start`` hooks (of the
  callbacks and the LightningModule): what they set up that no checkpoint holds is missing (StochasticWeightAveraging's
  SWALR scheduler: the learning rate lags one epoch); and ``on_advance_end`` does not step a plateau (monitor-based)
  scheduler at the end of the resumed epoch (ReduceLROnPlateau's final lr differs);
- resumed from a checkpoint written after an epoch's last batch (``ModelCheckpoint(every_n_train_steps=k)``), the
  epoch's validation is fast-forwarded (its counters set to the end) and its ``on_train_epoch_end`` hooks, its plateau
  step and the next epoch's ``on_train_epoch_start`` hooks are skipped: EarlyStopping and ``ModelCheckpoint(monitor=)``
  miss that epoch's score (other epochs run, other top-k files kept), SWA averages once less;
- resumed after a batch at which validation was due (``val_check_interval``), that validation is fast-forwarded;
- resumed from a checkpoint written at the end of an epoch's validation pass or in ``on_train_epoch_end``, that
  epoch's plateau step is skipped.

:class:`ResumeReplay` (added by the deterministic strategies) wraps the fit loop's methods on the Trainer instance and
replays each of these where the uninterrupted run had it, with the counters that run had (``current_epoch``, the
loggers' step): validation runs on its own streams (:mod:`~lightning_determinism.seeding.isolation`), so the training
bits do not move. The epoch-start hooks replayed in the middle of an epoch already ran before the checkpoint: what a
checkpoint holds (the callbacks' ``state_dict``, the optimizer's hyper-parameters, the module's buffers) is put back
after them and nothing is logged, so only what no checkpoint holds is rebuilt (SWA's scheduler, attributes a hook
sets). The monitored values (``trainer.callback_metrics``) travel in the checkpoint, for a plateau step or a monitor
that reads a value logged before it.

What cannot be made exact is said in one :class:`~lightning_determinism.DeterminismWarning` (rank 0) at the resume:
epoch-level values logged during an interrupted epoch (``self.log(..., on_epoch=True)`` in ``training_step``)
aggregate only the batches after the resume, as Lightning keeps no logged values in checkpoints; an epoch-start hook
replayed in the middle of an epoch that draws random numbers draws other ones than the uninterrupted run did.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_determinism._compat import loops
from lightning_determinism.errors import DeterminismWarning
from lightning_determinism.seeding.isolation import evaluation_streams
from lightning_determinism.seeding.rank_states import digest
from lightning_determinism.seeding.rng import capture_rng_state


def _same(a: Any, b: Any) -> bool:
    """Deep equality of two ``state_dict`` values, tensors compared bitwise (a DTensor by its local shard)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        a, b = (t.to_local() if hasattr(t, "to_local") else t for t in (a, b))
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    try:
        return bool(a == b)
    except Exception:  # an object without a meaningful ==: taken as changed, so its state is put back
        return False


class _Kept:
    """What a checkpoint holds, taken before a replay of hooks that already ran before it, and put back after."""

    def __init__(self, trainer: pl.Trainer, keeper: Callback) -> None:
        callbacks = [cb for cb in trainer.callbacks if cb is not keeper]  # type: ignore[attr-defined]
        self.callbacks = [(cb, copy.deepcopy(cb.state_dict())) for cb in callbacks]
        self.groups = [
            [{key: copy.deepcopy(value) for key, value in group.items() if key != "params"} for group in groups]
            for groups in (opt.param_groups for opt in trainer.optimizers)
        ]
        self.module = trainer.lightning_module
        self.buffers = {name: buffer.detach().clone() for name, buffer in self.module.named_buffers()}

    def restore(self, trainer: pl.Trainer) -> None:
        for callback, state in self.callbacks:
            if state and not _same(callback.state_dict(), state):
                callback.load_state_dict(state)
        # SWA's SWALR sets every group's lr when it is built (and derives later lrs from the current one).
        for opt, groups in zip(trainer.optimizers, self.groups, strict=True):
            for group, saved in zip(opt.param_groups, groups, strict=True):
                group.update(saved)
        with torch.no_grad():
            for name, buffer in self.module.named_buffers():
                kept = self.buffers.get(name)
                if kept is not None and not _same(buffer, kept):
                    buffer.copy_(kept)


class ResumeReplay(Callback):
    """Replay on a resumed fit what Lightning's restart skips (see the module's docstring); added by the strategies.

    Its ``state_dict`` holds the monitored values (``trainer.callback_metrics``, tensors), the epoch, and the names of
    the epoch-level values the epoch had aggregated.

    Examples:
        >>> ResumeReplay().state_dict()
        {'callback_metrics': {}, 'aggregated': [], 'epoch': 0}
    """

    def __init__(self) -> None:
        self._trainer: pl.Trainer | None = None
        self._loaded: dict[str, Any] | None = None
        self._versions: list[tuple[Any, Any]] = []  # ModelCheckpoints writing over, during a replayed pass

    @override
    def state_dict(self) -> dict[str, Any]:
        trainer = self._trainer
        if trainer is None:
            return {"callback_metrics": {}, "aggregated": [], "epoch": 0}
        metrics = {
            str(key): value.detach().cpu().clone()
            for key, value in loops.stored_callback_metrics(trainer).items()
            if isinstance(value, torch.Tensor)
        }
        aggregated = loops.epoch_aggregates(trainer)
        return {"callback_metrics": metrics, "aggregated": aggregated, "epoch": int(trainer.current_epoch)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = dict(state_dict)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer
        if stage != "fit" or "on_run_start" in vars(trainer.fit_loop):
            return
        fit_loop = trainer.fit_loop
        val_loop = fit_loop.epoch_loop.val_loop
        fit_loop.on_run_start = self._after(fit_loop.on_run_start, self._replay_epoch_end)  # type: ignore[method-assign]
        fit_loop.on_advance_start = self._after(fit_loop.on_advance_start, self._replay_epoch_start)  # type: ignore[method-assign]
        fast_forward = val_loop.increment_progress_to_evaluation_end
        val_loop.increment_progress_to_evaluation_end = functools.partial(self._validate, fast_forward)  # type: ignore[method-assign]

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for name in ("on_run_start", "on_advance_start"):
            vars(trainer.fit_loop).pop(name, None)
        val_loop = trainer.fit_loop.epoch_loop.val_loop
        wrapped = vars(val_loop).get("increment_progress_to_evaluation_end")
        if isinstance(wrapped, functools.partial):  # else already taken off (the evaluation isolation's detach)
            val_loop.increment_progress_to_evaluation_end = wrapped.args[0]  # type: ignore[method-assign]
        self._loaded = None
        self._end_replayed_pass()

    def _end_replayed_pass(self) -> None:
        loops.restore_checkpoint_versions(self._versions)
        self._versions = []

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._end_replayed_pass()  # the replayed pass's saves are done (checkpoint callbacks run after this one)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end_replayed_pass()  # after the replayed epoch end's saves (ModelCheckpoint saves in its epoch end too)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loaded, self._loaded = self._loaded, None
        if loaded is None:
            return
        device, stored = pl_module.device, loops.stored_callback_metrics(trainer)
        for key, value in loaded.get("callback_metrics", {}).items():
            stored.setdefault(key, value.to(device))  # as the run that wrote the checkpoint had them
        aggregated = loaded.get("aggregated") or []
        if aggregated and loops.fit_stage(trainer) in (loops.MID_EPOCH, loops.EPOCH_END):
            names = ", ".join(f"'{name}'" for name in aggregated)
            rank_zero_warn(
                f"Resumed from a checkpoint written before the end of epoch {loaded.get('epoch')}: the epoch-level"
                f" values of {names} (self.log(..., on_epoch=True) during training) aggregate only the batches trained"
                " after the resume (Lightning keeps no logged values in checkpoints); their logged epoch values, and"
                " what monitors them (EarlyStopping, ModelCheckpoint, ReduceLROnPlateau), can differ from the"
                " uninterrupted run.",
                category=DeterminismWarning,
            )

    @staticmethod
    def _after(method: Any, replay: Any) -> Any:
        @functools.wraps(method)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            stage = loops.fit_stage(method.__self__.trainer)
            result = method(*args, **kwargs)
            replay(method.__self__.trainer, stage)
            return result

        return wrapped

    def _replay_epoch_end(self, trainer: pl.Trainer, stage: str) -> None:
        """After ``on_train_start``: what followed a checkpoint written at an epoch's last batch or at its end."""
        batches = trainer.fit_loop.epoch_loop.batch_progress
        if stage == loops.MID_EPOCH and loops.batch_stage(trainer) == loops.AFTER_BATCH and batches.is_last_batch:
            # Lightning counted the epoch as done (FitLoop.reset): back to where the uninterrupted run was after its
            # last batch, then that run's steps: validation if due, the plateau step, the epoch-end hooks and logs.
            loops.shift_epoch_counters(trainer, processed=-1, completed=-1)
            batches.increment_completed()
            loops.end_restart(trainer)  # and the next epoch starts as in the uninterrupted run, with its hooks
            self._versions = loops.suspend_checkpoint_versions(trainer.callbacks)  # type: ignore[attr-defined]
            loops.finish_batch(trainer)
            loops.finish_epoch(trainer)
        elif stage == loops.EPOCH_END:  # written in on_train_epoch_end: the plateau step came after the hooks
            loops.shift_epoch_counters(trainer, completed=-1)  # the epoch Lightning counted as completed
            try:
                loops.step_plateau_schedulers(trainer)
            finally:
                loops.shift_epoch_counters(trainer, completed=1)

    def _replay_epoch_start(self, trainer: pl.Trainer, stage: str) -> None:
        """At a mid-epoch resume: the epoch-start hooks Lightning skipped; a plateau step at the epoch's end."""
        if stage != loops.MID_EPOCH:
            return
        kept = _Kept(trainer, keeper=self)
        loggers = trainer.loggers
        trainer.loggers = []  # the uninterrupted run logged this before the checkpoint
        hooks = [(cb, functools.partial(loops.call_callback, trainer, cb)) for cb in trainer.callbacks]  # type: ignore[attr-defined]
        hooks.append((trainer.lightning_module, functools.partial(loops.call_module, trainer)))
        drew = []
        try:
            # On streams of its own: the training streams stay as the checkpoint saved them (drawn after the hooks).
            with evaluation_streams("resume", trainer.current_epoch, trainer.global_step, rank=trainer.global_rank):
                for owner, call in hooks:
                    before = digest(capture_rng_state())
                    call("on_train_epoch_start")
                    if digest(capture_rng_state()) != before:
                        drew.append(type(owner).__name__)
        finally:
            trainer.loggers = loggers
        kept.restore(trainer)
        loops.keep_stepping_plateau(trainer)
        if drew:
            rank_zero_warn(
                f"Resumed in the middle of epoch {trainer.current_epoch}: the on_train_epoch_start hook of"
                f" {', '.join(drew)} draws random numbers. Replayed at the resume to rebuild what it sets up (no"
                " checkpoint holds it), it drew other numbers than in the uninterrupted run (the training streams are"
                " kept as saved), so what it set from them can differ.",
                category=DeterminismWarning,
            )

    def _validate(self, fast_forward: Any, *args: Any, **kwargs: Any) -> Any:
        """Validation due after the checkpoint's batch: run it (on its own streams) where Lightning skips it."""
        trainer = self._trainer
        if trainer is None or loops.batch_stage(trainer) != loops.AFTER_BATCH:
            return fast_forward(*args, **kwargs)
        loops.shift_batches_that_stepped(trainer, -1)  # counted by the restart; the uninterrupted run validated first
        # The interrupted run may have run this pass already and written its ModelCheckpoint files (a job that died
        # after the pass, resumed from the checkpoint before it): the replayed pass writes over them, as the
        # uninterrupted run wrote them once, instead of adding a `-v1` copy that best_k_models would then point to.
        self._versions = loops.suspend_checkpoint_versions(trainer.callbacks)  # type: ignore[attr-defined]
        trainer.fit_loop.epoch_loop.val_loop.restarting = False
        loops.finish_batch(trainer)
        return None


__all__ = ["ResumeReplay"]
