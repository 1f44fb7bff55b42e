"""Where each training loader stands: the positions a checkpoint keeps, and the plan a resumed run takes them from.

:func:`loader_positions` (called by :class:`~lightning_determinism.RNGStateCheckpoint` when it saves) derives, per
training loader, the epoch to resume in and how far into it: batches to skip and the epoch's RNG states for map-style
loaders (:mod:`~lightning_determinism.data.resumable`), a stream's per-worker position
(:mod:`~lightning_determinism.data.streams`), a stateful loader's own state
(:mod:`~lightning_determinism.data.stateful`).
A resumed run keeps them as a plan (:func:`set_plan`) that each loader takes at its first batch (:func:`take_resume`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.utils.data import DataLoader

from lightning_determinism._compat import combined_loader, combined_mode
from lightning_determinism.data.stateful import is_stateful_loader
from lightning_determinism.data.stream_loader import stream_entry

PLAN_ATTR = "_ldet_resume_plan"
"""Attribute of the trainer holding the per-loader resume states read from a checkpoint, until they are used."""


def is_converted(loader: object) -> bool:
    """Whether the strategies converted this loader (see :func:`make_resumable`)."""
    return bool(getattr(type(loader), "_ldet_converted", False))


def current_epoch(trainer: Any) -> int:
    """The training epoch the loop is in (0 without a trainer)."""
    return int(trainer.fit_loop.epoch_progress.current.processed) if trainer is not None else 0


def next_train_epoch(trainer: Any) -> int:
    """The epoch the next training iterator serves: a pending resume's, else the loop's.

    Examples:
        >>> next_train_epoch(None)
        0
    """
    plan = [entry for entry in getattr(trainer, PLAN_ATTR, None) or [] if entry is not None]
    if plan:
        return int(plan[0]["epoch"])
    return current_epoch(trainer)


def set_plan(trainer: Any, states: Sequence[dict[str, Any] | None] | None) -> None:
    """Keep the per-loader states saved for this rank; each training loader takes its own at its first batch."""
    setattr(trainer, PLAN_ATTR, list(states) if states else None)


def take_resume(trainer: Any, loader: Any) -> dict[str, Any] | None:
    """The saved position this loader resumes at, taken once (the loader's own, Fabric; else the trainer's plan)."""
    pending = getattr(loader, PLAN_ATTR, None)  # Fabric: FabricRNGState gives each loader its own
    if pending is not None:
        setattr(loader, PLAN_ATTR, None)
        return pending  # type: ignore[no-any-return]
    plan = getattr(trainer, PLAN_ATTR, None)
    if not plan:
        return None
    combined = combined_loader(trainer)
    loaders = list(combined.flattened) if combined is not None else [loader]
    slot = next((i for i, other in enumerate(loaders) if other is loader), None)
    if slot is None or slot >= len(plan) or plan[slot] is None:
        return None
    state, plan[slot] = plan[slot], None
    if all(entry is None for entry in plan):
        setattr(trainer, PLAN_ATTR, None)
    return state


def consumed_batches(trainer: Any) -> int:
    """Batches of the current epoch a resumed run must not run again, as Lightning counts them on restart.

    A checkpoint written at the end of a batch (``on_train_batch_end``) resumes after it; one written during a batch
    (on an exception) repeats it.
    """
    batches = trainer.fit_loop.epoch_loop.batch_progress.current
    done_batch = batches.ready == batches.started == batches.processed == batches.completed + 1
    return int(batches.processed if done_batch else batches.completed)


def mark_stream_start(trainer: Any) -> None:
    """At a training batch's start: the loop's batch count from which each new stream iterator counts its own."""
    combined = combined_loader(trainer)
    for loader in combined.flattened if combined is not None else []:
        if getattr(loader, "_ldet_stream", False) and getattr(loader, "_ldet_position", None) is not None:
            if loader._ldet_counter_base is None:
                ready = int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)
                loader._ldet_counter_base = ready - 1 - loader._ldet_position.saved_batches
                loader._ldet_pending = None  # the resume is in use (see ResumableLoaderMixin._ldet_create_stream)


def loader_positions(trainer: Any) -> list[dict[str, Any]]:
    """Per training loader: the epoch to resume in, batches to skip, and the epoch's saved RNG states.

    Derived from Lightning's loop counters the way Lightning restarts: a checkpoint written at the end of a batch
    resumes after it, one written mid-batch (an exception) repeats it; a finished epoch resumes at the next one.
    """
    fit_loop = trainer.fit_loop
    combined = combined_loader(trainer)
    if combined is None:
        return []
    epochs = fit_loop.epoch_progress.current
    mid_epoch = epochs.processed < epochs.started
    consumed = consumed_batches(trainer)
    total = trainer.num_training_batches
    finished = not mid_epoch or consumed >= total
    epoch = int(epochs.processed) + (1 if mid_epoch and finished else 0)
    limits = getattr(combined, "limits", None) or [None] * len(combined.flattened)
    positions: list[dict[str, Any]] = []
    for loader, limit in zip(combined.flattened, limits, strict=False):
        if is_stateful_loader(loader) and hasattr(loader, "_ldet_position_at"):
            positions.append({"epoch": epoch, **loader._ldet_position_at(consumed, finished)})
            continue
        if is_converted(loader) and getattr(loader, "_ldet_stream", False):
            positions.append(stream_entry(loader, consumed, epoch))  # by the stream's own count (see there)
            continue
        if finished or not (is_converted(loader) and loader._ldet_resumable):
            entry: dict[str, Any] = {"epoch": epoch, "skip": 0, "epoch_start": None}
            if not finished and consumed:  # neither restorable nor replayable: said at resume (RNGStateCheckpoint)
                entry["restarts"] = type(loader).__name__
                entry["dataloader"] = isinstance(loader, DataLoader)
            positions.append(entry)
            continue
        length = int(limit) if limit not in (None, float("inf")) else len(loader)  # type: ignore[arg-type]
        cycles = combined_mode(combined) == "max_size_cycle" and length < total
        skip = consumed % length if cycles and length else min(consumed, length)
        positions.append({"epoch": epoch, "skip": int(skip), "epoch_start": loader._ldet_epoch_start})
    return positions


__all__ = [
    "PLAN_ATTR",
    "consumed_batches",
    "current_epoch",
    "is_converted",
    "loader_positions",
    "mark_stream_start",
    "next_train_epoch",
    "set_plan",
    "take_resume",
]
