"""The loader side of resumable streams: creating a converted stream loader's iterator, and its saved position.

Called by :class:`~lightning_determinism.data.resumable.ResumableLoaderMixin` for a ``DataLoader`` over an
``IterableDataset`` (see :mod:`~lightning_determinism.data.streams` for the mechanism).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

from lightning_determinism.data.elastic_streams import LAYOUT, layout_of
from lightning_determinism.data.stream_state import IsolatedStreams
from lightning_determinism.data.streams import (
    StreamIterator,
    StreamPlan,
    StreamPosition,
    StreamProxy,
    TagCollate,
)
from lightning_determinism.errors import DeterminismWarning
from lightning_determinism.seeding.seeds import _rank_and_world_size, current_seeds


def stream_plan(loader: Any, trainer: Any) -> StreamPlan:
    """The loader's plan, made at its first iterator (the base seed and rank are known by then)."""
    plan = getattr(loader, "_ldet_stream_plan", None)
    if plan is None:
        base = current_seeds()["base_seed"]
        if trainer is not None:
            rank = int(trainer.global_rank)
        else:
            rank = _rank_and_world_size()[0]
        plan = StreamPlan(0 if base is None else int(base), rank)
        loader._ldet_stream_plan = plan
        loader._ldet_isolated = IsolatedStreams()
    return plan  # type: ignore[no-any-return]


@contextlib.contextmanager
def _standing_in(loader: Any, proxy: StreamProxy, collate: TagCollate) -> Iterator[None]:
    """The proxy and the tagging collate function in the loader while it creates an iterator (read at creation)."""
    dataset, collate_fn = loader.dataset, loader.collate_fn
    object.__setattr__(loader, "dataset", proxy)  # DataLoader refuses `dataset` assignments after __init__
    loader.collate_fn = collate
    try:
        yield
    finally:
        object.__setattr__(loader, "dataset", dataset)
        loader.collate_fn = collate_fn


def _resume_plan(
    loader: Any, plan: StreamPlan, epoch: int, saved: dict[str, Any] | None, grid: list[dict[str, Any]] | None
) -> tuple[int, dict[str, Any] | None]:
    """Load ``saved`` (this rank's position from a checkpoint; ``grid``: every rank's) into ``plan``.

    Returns the worker whose batch comes first and the position to count on from (``None``: a fresh count).
    """
    plan.resume_epoch, plan.resume, plan.elastic = -1, {}, None
    if saved is None:
        return 0, None
    workers = max(1, int(loader.num_workers))
    before = {**plan.layout, **{key: saved[key] for key in LAYOUT if key in saved}, "workers": int(saved["workers"])}
    if grid is not None:
        before["world"] = len(grid)
    if before == {**plan.layout, "workers": workers}:  # the same grid: continue each worker's stream
        plan.resume_epoch = epoch
        plan.resume = {
            w: {"items": int(saved["items"][w]), "digest": int(saved["digests"][w]), "state": saved["states"][w]}
            for w in range(workers)
        }
        plan.elastic = saved.get("origin")  # the epoch was itself the rest of an earlier grid's
        return (int(saved["last_worker"]) + 1) % workers, saved
    name = type(loader.dataset).__name__
    now = plan.layout
    changed = ", ".join(f"{key} {before[key]} -> {now[key]}" for key in LAYOUT if before[key] != now[key])
    if grid is None:
        warnings.warn(
            f"The position of `{name}` was saved on another grid ({changed or 'workers'}) and the checkpoint has no"
            " position of the other ranks: the interrupted epoch of this stream restarts at its first sample, so"
            " samples already trained on in it are seen again.",
            DeterminismWarning,
            stacklevel=2,
        )
        return 0, None
    warnings.warn(
        f"`{name}` resumes on another grid ({changed}): the rest of the interrupted epoch is every sample it had not"
        " delivered, each once and with its own content bit for bit, but in other batches, so the run is not the"
        " uninterrupted one (docs/streaming.md, elastic resume).",
        DeterminismWarning,
        stacklevel=2,
    )
    plan.resume_epoch = epoch
    plan.resume = {w: {"items": 0, "digest": 0, "state": None} for w in range(workers)}
    plan.elastic = grid
    return 0, None


def _world(trainer: Any) -> int:
    return int(trainer.world_size) if trainer is not None else _rank_and_world_size()[1]


def create_stream_iterator(
    loader: Any, trainer: Any, epoch: int, saved: dict[str, Any] | None, create: Any, grid: list[Any] | None = None
) -> Any:
    """The iterator of a converted stream loader for ``epoch``, resuming at ``saved`` (a position) when given.

    ``grid``: every rank's saved position, when the checkpoint had them: a resume on another grid continues the
    interrupted epoch there (:mod:`~lightning_determinism.data.elastic_streams`).

    ``create()`` builds PyTorch's iterator the way the loader does for map-style data (saved RNG states, fork
    safety); here it runs with the proxy and the tagging collate function standing in.
    """
    plan = stream_plan(loader, trainer)
    plan.epoch.fill_(epoch)
    plan.layout = layout_of(loader, _world(trainer))
    workers = max(1, int(loader.num_workers))
    first, keep = _resume_plan(loader, plan, epoch, saved, grid)
    isolated = loader._ldet_isolated if int(loader.num_workers) == 0 else None
    proxy = StreamProxy(loader.dataset, plan, loader.batch_sampler is not None, isolated)
    collate = TagCollate(loader.collate_fn, plan.token, loader.batch_sampler is not None)
    with _standing_in(loader, proxy, collate):
        inner = create()
    position = StreamPosition(workers, keep, {**plan.layout, "origin": plan.elastic})
    loader._ldet_position = position
    return _Warning(StreamIterator(inner, position, first, isolated), loader)


class _Warning:
    """Passes the batches on; warns once if a worker's replay did not reproduce what the saved run delivered."""

    def __init__(self, inner: StreamIterator, loader: Any) -> None:
        self.inner, self.name, self.loader = inner, type(loader.dataset).__name__, loader
        self._warned = self._padded = False
        loader._ldet_epoch_done = False

    def __iter__(self) -> _Warning:
        return self

    def __next__(self) -> Any:
        try:
            batch = next(self.inner)
        except StopIteration:
            self.loader._ldet_epoch_done = True
            raise
        if self.inner.padded and not self._padded:
            self._padded = True
            warnings.warn(
                f"Resumed on another grid, `{self.name}` had fewer samples left for its last batch than there are"
                f" ranks: this rank repeats {self.inner.padded} of them so that every rank has as many batches.",
                DeterminismWarning,
                stacklevel=2,
            )
        if self.inner.replay_failures and not self._warned:
            self._warned = True
            warnings.warn(
                f"`{self.name}` did not replay the samples it delivered before the checkpoint (worker(s)"
                f" {sorted(set(self.inner.replay_failures))}): its order is not a function of the seeds (a source"
                " that changes, randomness of its own). The resume skipped as many samples as were consumed, but not"
                " the same ones. Give the dataset `state_dict()` / `load_state_dict()` (docs/streaming.md).",
                DeterminismWarning,
                stacklevel=2,
            )
        return batch


def stream_entry(loader: Any, consumed: int, loop_epoch: int) -> dict[str, Any]:
    """The saved position of a converted stream loader, ``consumed`` being the training loop's batch counter.

    By the stream's own epoch and count, not the loop's (see ``ResumableLoaderMixin._ldet_create_stream``): an
    epoch whose end was fetched and whose batches were all consumed resumes at the next epoch's start.
    """
    position: StreamPosition | None = getattr(loader, "_ldet_position", None)
    if position is None:
        return {"epoch": loop_epoch, "skip": 0, "epoch_start": None}
    epoch = int(loader._ldet_stream_plan.epoch)
    base = loader._ldet_counter_base
    own = position.saved_batches if base is None else consumed - int(base)  # None: no batch of it trained yet
    if getattr(loader, "_ldet_epoch_done", False) and own == position.batches:
        return {"epoch": epoch + 1, "skip": 0, "epoch_start": None}
    return {"epoch": epoch, "skip": 0, "epoch_start": None, "stream": position.at(own)}


__all__ = ["create_stream_iterator", "stream_entry", "stream_plan"]
