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

from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, SequentialSampler

from lightning_determinism._compat.access import combined_loader, combined_mode
from lightning_determinism.data.deal import deal_entry
from lightning_determinism.data.stream_loader import stream_entry
from lightning_determinism.errors import DeterminismWarning

PLAN_ATTR = "_ldet_resume_plan"
"""Attribute of the trainer holding the per-loader resume states read from a checkpoint, until they are used."""


def is_converted(loader: object) -> bool:
    """Whether the strategies converted this loader (see :func:`make_resumable`)."""
    return bool(getattr(type(loader), "_ldet_converted", False))


def is_stateful_loader(loader: object) -> bool:
    """Whether ``loader`` is a ``DataLoader`` whose own class defines ``state_dict`` and ``load_state_dict``.

    Examples:
        >>> is_stateful_loader(DataLoader(range(3)))
        False
    """
    if not isinstance(loader, DataLoader):
        return False
    for cls in type(loader).__mro__:
        if cls in (DataLoader, object) or "_ldet_converted" in vars(cls):
            continue  # ours: the resumable loaders' marker state_dict, the stateful loaders' load_state_dict
        if "state_dict" in vars(cls) and "load_state_dict" in vars(cls):
            return True
    return False


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


def _plan_slot(trainer: Any, loader: Any) -> int | None:
    """The index of ``loader``'s entry in the trainer's plan, if it has one."""
    plan = getattr(trainer, PLAN_ATTR, None)
    if not plan:
        return None
    combined = combined_loader(trainer)
    loaders = list(combined.flattened) if combined is not None else [loader]
    slot = next((i for i, other in enumerate(loaders) if other is loader), None)
    if slot is None or slot >= len(plan) or plan[slot] is None:
        return None
    return slot


def peek_resume(trainer: Any, loader: Any) -> dict[str, Any] | None:
    """The saved position this loader will resume at (:func:`take_resume`), left in place.

    Examples:
        >>> peek_resume(None, DataLoader(range(3))) is None
        True
    """
    pending = getattr(loader, PLAN_ATTR, None)
    if pending is not None:
        return pending  # type: ignore[no-any-return]
    slot = _plan_slot(trainer, loader)
    return None if slot is None else getattr(trainer, PLAN_ATTR)[slot]  # type: ignore[no-any-return]


def take_resume(trainer: Any, loader: Any) -> dict[str, Any] | None:
    """The saved position this loader resumes at, taken once (the loader's own, Fabric; else the trainer's plan)."""
    pending = getattr(loader, PLAN_ATTR, None)  # Fabric: FabricRNGState gives each loader its own
    if pending is not None:
        setattr(loader, PLAN_ATTR, None)
        return pending  # type: ignore[no-any-return]
    slot = _plan_slot(trainer, loader)
    if slot is None:
        return None
    plan = getattr(trainer, PLAN_ATTR)
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
        entry = {
            "epoch": epoch,
            "skip": int(skip),
            "epoch_start": loader._ldet_epoch_start,
            "shape": loader_shape(loader),
        }
        deal = deal_entry(loader, int(skip)) if skip else None
        if deal is not None:  # resumed on another number of replicas, the rest of the epoch is dealt anew
            entry["deal"] = deal
        positions.append(entry)
    return positions


def stock_positions(trainer: Any) -> list[dict[str, Any] | None]:
    """Positions of a mid-epoch checkpoint that holds none (stock Lightning's), from the loops' restored counters.

    Where a loader's order in an epoch depends on the epoch alone (a ``DistributedSampler``, the world-size-invariant
    sampler, no shuffling) the resumed loader skips the batches Lightning counts as done: every sample of the epoch
    once, at the right step. Anything else (a ``RandomSampler`` draws its order from RNG state the checkpoint does not
    hold, a stream) restarts the epoch in a new order while Lightning still counts the batches done, so the epoch
    trains only as many batches as it had left: said in one warning, naming the loader.
    """
    combined = combined_loader(trainer)
    loaders = list(combined.flattened) if combined is not None else []
    epochs = trainer.fit_loop.epoch_progress.current
    consumed = consumed_batches(trainer)
    if epochs.processed >= epochs.started or not consumed or consumed >= trainer.num_training_batches:
        return [None] * len(loaders)  # at an epoch boundary: nothing to skip
    positions: list[dict[str, Any] | None] = []
    for loader, entry in zip(loaders, loader_positions(trainer), strict=True):
        map_style = is_converted(loader) and loader._ldet_resumable and not getattr(loader, "_ldet_stream", False)
        if map_style and order_depends_on_epoch_only(loader):
            positions.append({"epoch": int(epochs.processed), "skip": int(entry["skip"]), "epoch_start": None})
            continue
        positions.append(None)
        rank_zero_warn(
            f"The checkpoint was written {consumed} batches into epoch {int(epochs.processed)} without a data"
            f" position (stock Lightning's), and the training loader `{type(loader).__name__}` draws its order from"
            " state the checkpoint does not hold: the epoch restarts at its first sample and, as Lightning counts"
            f" {consumed} batches done, trains only the batches it had left: some samples are trained twice in this"
            " epoch and others not at all. Resume from an epoch-boundary checkpoint, or from one written under the"
            " deterministic strategies.",
            category=DeterminismWarning,
        )
    return positions


def order_depends_on_epoch_only(loader: Any) -> bool:
    """Whether a map-style loader's order in an epoch is a function of the epoch (and a seed) alone."""
    if isinstance(getattr(loader, "dataset", None), IterableDataset):
        return False
    batch_sampler = getattr(loader, "batch_sampler", None)
    sampler = getattr(batch_sampler, "sampler", None) if batch_sampler is not None else getattr(loader, "sampler", None)
    if isinstance(sampler, SequentialSampler):
        return True
    if type(sampler).__name__ == "InvariantSampler":  # the world-size-invariant sampler: (seed, epoch) only
        return True
    # DistributedSampler shuffles by (seed, epoch); Lightning's wrapper of a user's sampler follows that sampler's RNG
    return isinstance(sampler, DistributedSampler) and type(sampler).__name__ != "DistributedSamplerWrapper"


def loader_shape(loader: Any) -> dict[str, int]:
    """What a saved position in a map-style loader's epoch is relative to: samples, batch size, workers.

    ``per_sample``: 1 where every sample's randomness depends on (seed, epoch, index) only (``WorkerSeedCallback
    (per_sample=True)``), so the number of workers cannot change a sample.

    Examples:
        >>> loader_shape(DataLoader(range(10), batch_size=4))
        {'length': 10, 'batch_size': 4, 'drop_last': 0, 'num_workers': 0, 'per_sample': 0}
    """
    dataset = getattr(loader, "dataset", None)
    getitems = getattr(dataset, "__getitems__", None)
    try:
        length = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        length = -1
    batch_size = getattr(loader, "batch_size", None)
    return {
        "length": int(length),
        "batch_size": -1 if batch_size is None else int(batch_size),  # a batch sampler of the user's: -1
        "drop_last": int(bool(getattr(loader, "drop_last", False))),
        "num_workers": int(getattr(loader, "num_workers", 0)),
        "per_sample": int(bool(getattr(getitems, "ldet_per_sample", False))),
    }


def shape_change(saved: dict[str, Any], loader: Any) -> tuple[list[str], list[str]]:
    """How ``loader`` differs from the one a mid-epoch position was saved in: (what moves samples, what moves bits).

    A different length, batch size or ``drop_last`` puts the saved count of batches at other samples (refused); other
    ``num_workers`` without per-sample seeds draw other numbers in the workers (warned).
    """
    now = loader_shape(loader)
    moved = [f"{key} {saved[key]} -> {now[key]}" for key in ("length", "batch_size", "drop_last")
             if key in saved and saved[key] != now[key]]  # fmt: skip
    bits = []
    if "num_workers" in saved and saved["num_workers"] != now["num_workers"] and not now["per_sample"]:
        bits.append(f"num_workers {saved['num_workers']} -> {now['num_workers']}")
    return moved, bits


__all__ = [
    "PLAN_ATTR",
    "consumed_batches",
    "current_epoch",
    "is_converted",
    "is_stateful_loader",
    "loader_positions",
    "mark_stream_start",
    "next_train_epoch",
    "order_depends_on_epoch_only",
    "loader_shape",
    "peek_resume",
    "set_plan",
    "shape_change",
    "stock_positions",
    "take_resume",
]
