"""The fit loop's private pieces that replaying a resumed fit (and stopping a preempted one) reads and calls.

``callbacks._resume_replay`` replays what a resumed fit skips; ``callbacks.preemption`` tears down the training
loader of a fit stopped in a validation pass.

Lightning has no public hook between restoring a checkpoint and the first resumed batch, nor a public view of where
its loops restart: the restart stages, the progress counters and the loops' own steps are read and called here, each
through :func:`~lightning_determinism._compat.access._private` (a clear error naming the versions if one is gone).
:data:`~lightning_determinism._compat.pieces.PIECES` checks them when a deterministic strategy is built.
"""

from __future__ import annotations

from typing import Any

from lightning_determinism._compat.access import _private

MID_EPOCH = "restarted_mid_epoch"  # _FitLoop's stage: the checkpoint's epoch was unfinished
EPOCH_END = "resumed_on_epoch_end"  # _FitLoop's stage: written in on_train_epoch_end
AFTER_BATCH = "restarted_on_train_batch_end"  # _TrainingEpochLoop's stage: written in on_train_batch_end


def fit_stage(trainer: Any) -> str:
    """The fit loop's restart stage after its ``reset`` (``"none"`` when not resumed)."""
    return str(_private(trainer.fit_loop, "_restart_stage"))


def batch_stage(trainer: Any) -> str:
    """The training epoch loop's restart stage (``"restarted_on_train_batch_end"``, ...)."""
    return str(_private(trainer.fit_loop.epoch_loop, "_restart_stage"))


def call_callback(trainer: Any, callback: Any, hook: str) -> None:
    """Call one callback's ``hook`` as the loops do (the module's current hook name set, for ``self.log``)."""
    module = trainer.lightning_module
    previous = _private(module, "_current_fx_name")
    module._current_fx_name = hook
    try:
        getattr(callback, hook)(trainer, module)
    finally:
        module._current_fx_name = previous


def call_module(trainer: Any, hook: str) -> None:
    """Call the LightningModule's ``hook`` as the loops do."""
    from lightning.pytorch.trainer import call

    _private(call, "_call_lightning_module_hook")(trainer, hook)


def shift_epoch_counters(trainer: Any, processed: int = 0, completed: int = 0) -> None:
    """Move the fit loop's count of processed and completed epochs (``current_epoch`` is the completed ones)."""
    progress = trainer.fit_loop.epoch_progress
    for counters in (progress.total, progress.current):
        counters.processed += processed
        counters.completed += completed


def shift_batches_that_stepped(trainer: Any, by: int) -> None:
    """Move the loggers' step (the count of optimizer steps the loop logged) by ``by``."""
    loop = trainer.fit_loop.epoch_loop
    loop._batches_that_stepped = int(_private(loop, "_batches_that_stepped")) + by


def finish_batch(trainer: Any) -> None:
    """What the training epoch loop does after a batch: validation if due, the plateau step, the loggers' step."""
    _private(trainer.fit_loop.epoch_loop, "on_advance_end")(_private(trainer.fit_loop, "_data_fetcher"))


def finish_epoch(trainer: Any) -> None:
    """What the fit loop does after an epoch: the epoch-end hooks, the plateau step, the epoch's logs."""
    _private(trainer.fit_loop, "on_advance_end")()


def step_plateau_schedulers(trainer: Any) -> None:
    """Step the epoch-interval plateau (monitor-based) schedulers, as the fit loop does after an epoch's hooks."""
    loop = trainer.fit_loop.epoch_loop
    if _private(loop, "_num_ready_batches_reached")():
        _private(loop, "update_lr_schedulers")("epoch", update_plateau_schedulers=True)


def stored_callback_metrics(trainer: Any) -> dict[str, Any]:
    """The monitored values as last stored (``trainer.callback_metrics`` computes pending ones: a collective)."""
    return _private(_private(trainer, "_logger_connector"), "_callback_metrics")  # type: ignore[no-any-return]


def epoch_aggregates(trainer: Any) -> list[str]:
    """The names of the values training logs per epoch (``self.log(on_epoch=True)``) outside the epoch hooks."""
    results = _private(trainer.fit_loop.epoch_loop, "_results")
    names = set()
    for metric in _private(results, "result_metrics"):
        meta = _private(metric, "meta")
        if meta.on_epoch and meta.fx not in ("on_train_epoch_start", "on_train_epoch_end"):
            names.add(str(meta.name))
    return sorted(names)


def end_restart(trainer: Any) -> None:
    """The loops no longer restart: the next epoch starts as in an uninterrupted run (hooks, counters, iterator)."""
    fit_loop = trainer.fit_loop
    _private(fit_loop, "_restarting")
    fit_loop._restarting = False  # not its setter: under max_epochs=-1 that keeps it restarting
    fit_loop.epoch_loop.restarting = False  # the setter reaches the validation and optimization loops
    for loop in (fit_loop, fit_loop.epoch_loop, fit_loop.epoch_loop.val_loop):
        _private(loop, "reset_restart_stage")()


def keep_stepping_plateau(trainer: Any) -> None:
    """Let the fit loop step plateau schedulers at the resumed epoch's end (it does not while restarting).

    Only the fit loop's own flag: the epoch loop still restarts (its counters, the fast-forward of validation).
    """
    _private(trainer.fit_loop, "_restarting")
    trainer.fit_loop._restarting = False


def suspend_checkpoint_versions(callbacks: Any) -> list[tuple[Any, Any]]:
    """Have each ``ModelCheckpoint`` write over a file of the name it picks instead of adding ``-v1``.

    Returns what :func:`restore_checkpoint_versions` puts back (Lightning's ``enable_version_counter``, kept privately).
    """
    from lightning.pytorch.callbacks import ModelCheckpoint

    saved = []
    for callback in callbacks:
        if isinstance(callback, ModelCheckpoint) and hasattr(callback, "_enable_version_counter"):
            saved.append((callback, callback._enable_version_counter))
            callback._enable_version_counter = False
    return saved


def restore_checkpoint_versions(saved: list[tuple[Any, Any]]) -> None:
    """Undo :func:`suspend_checkpoint_versions`."""
    for callback, enabled in saved:
        callback._enable_version_counter = enabled


def shut_down_training_workers(trainer: Any) -> None:
    """Stop the training loader's worker processes now (its iterator dropped), as Lightning's teardown of a fit does.

    Lightning tears down only the loop running when a fit stops: stopped in a validation pass, the training loop's
    iterator (and its workers) would live on.
    """
    fetcher = _private(trainer.fit_loop, "_data_fetcher")
    if fetcher is not None:
        fetcher.teardown()


__all__ = [
    "restore_checkpoint_versions",
    "shut_down_training_workers",
    "suspend_checkpoint_versions",
    "AFTER_BATCH",
    "EPOCH_END",
    "MID_EPOCH",
    "batch_stage",
    "call_callback",
    "call_module",
    "end_restart",
    "epoch_aggregates",
    "finish_batch",
    "finish_epoch",
    "fit_stage",
    "keep_stepping_plateau",
    "shift_batches_that_stepped",
    "shift_epoch_counters",
    "step_plateau_schedulers",
    "stored_callback_metrics",
]
