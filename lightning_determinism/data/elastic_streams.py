"""A stream's interrupted epoch resumed on another grid: another world size, ``num_workers``, batch size.

A checkpoint keeps, for every (rank, worker) stream of the grid it was written on, how many items that stream had
delivered (:class:`~lightning_determinism.data.streams.StreamPosition`). On another grid each new (rank, worker):

1. **plays every old stream** in its own process, each with the identity it had -- ``torch.distributed``'s rank and
   world size, the ``RANK`` / ``WORLD_SIZE`` variables and ``get_worker_info()`` report the old ones while it runs --
   and its own RNG streams, seeded as the old worker seeded them; it restores the old position (the dataset's state
   protocol) or drops the items delivered (replay, digest-checked);
2. **orders what is left** as the uninterrupted run would have consumed it: step by step, old rank by old rank, each
   old rank's workers round-robin from the one due, batches of the old batch size;
3. **takes its share**: new rank ``r`` of ``W`` takes the items ``r, r + W, r + 2W, ...`` of that sequence; its items
   form batches of the new batch size, dealt to its workers round-robin (PyTorch's order).

Every remaining sample is consumed once, with its own content bitwise (worker-drawn randomness included), and every
rank gets the same number of batches. One exception: when fewer items than ranks are left over for a last batch and it
would open a batch on some ranks only, the other ranks repeat one item of it (DDP needs equal batch counts; a
warning says how many) -- with ``drop_last`` those items are dropped instead. Not the same: the grouping into batches
and the model's random numbers. The cost: the rest of the interrupted epoch reads every old stream once per new
(rank, worker); the next epoch runs on the new grid at full speed.

A run resumed on another grid can itself be checkpointed during that epoch and resumed on the same grid (bitwise) or
on yet another one (the old grid's epoch is then played as above, recursively).
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections import deque
from collections.abc import Iterator
from itertools import islice
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from lightning_determinism._compat.data import hf_as_node, worker_info_as
from lightning_determinism.data._index_skip import consume
from lightning_determinism.data.stream_state import (
    IsolatedStreams,
    has_state_protocol,
    item_digest,
    seed_stream,
    stream_seed,
)
from lightning_determinism.seeding.rng import restore_cpu_streams

LAYOUT = ("world", "num_workers", "batch_size", "drop_last")
"""What a stream's grid is made of; a resume on another one is elastic."""


class Layout:
    """A grid's shape from one (rank, worker)'s point of view: what :func:`share` deals by."""

    def __init__(self, world: int, workers: int, batch_size: int, drop_last: bool) -> None:
        self.world, self.workers, self.batch_size, self.drop_last = world, workers, batch_size, drop_last


class Grid(Layout):
    """The (rank, worker) streams of one epoch on the grid a checkpoint was written on (its ranks' positions)."""

    def __init__(self, positions: list[dict[str, Any]]) -> None:
        first = positions[0]
        workers, batch_size = int(first["workers"]), int(first.get("batch_size") or 1)
        super().__init__(len(positions), workers, batch_size, bool(first.get("drop_last", False)))
        self.positions = positions
        self.num_workers = int(first.get("num_workers", workers))
        origin = first.get("origin")
        self.origin = Grid(origin) if origin else None


class Checks:
    """What the plays found: replays whose last dropped item was not the saved one; items repeated for DDP."""

    def __init__(self) -> None:
        self.replay_ok = True
        self.padded = 0


@contextlib.contextmanager
def _identity(rank: int, world: int, worker: int, num_workers: int, seed: int, dataset: Any) -> Iterator[None]:
    """Within: this process reports the rank, world size and worker of an old stream."""
    names = ("is_initialized", "get_rank", "get_world_size")
    saved = [(module, name, getattr(module, name)) for module in (dist, c10d) for name in names]
    initialized = world > 1 or dist.is_initialized()
    fakes = {
        "is_initialized": lambda: initialized,
        "get_rank": lambda group=None: rank,
        "get_world_size": lambda group=None: world,
    }
    env = {key: os.environ.get(key) for key in ("RANK", "WORLD_SIZE")}
    for module, name, _ in saved:
        setattr(module, name, fakes[name])
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
    try:
        with worker_info_as(worker, num_workers, seed, dataset):
            yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class OldStream:
    """One (rank, worker) stream of a grid, played in this process from the start of its epoch or its saved state."""

    def __init__(self, dataset: Any, base: int, epoch: int, grid: Grid, rank: int, worker: int) -> None:
        self.dataset = copy.deepcopy(dataset)  # datasets keep their position on themselves (the state protocol)
        if is_hf(self.dataset):  # Hugging Face takes its node when split, not while it runs: give it the old one
            hf_as_node(self.dataset, rank, grid.world)
        self.streams = IsolatedStreams()
        self.seed = stream_seed(base, rank, worker, epoch)
        self.identity = (rank, grid.world, worker, grid.num_workers)
        state = grid.positions[rank]["states"][worker]
        with self._as_old():
            seed_stream(self.seed, self.dataset, epoch)
            if state is not None and has_state_protocol(self.dataset):
                self.dataset.load_state_dict(state["dataset"])
                self.iterator = iter(self.dataset)
                restore_cpu_streams(state["rng"])
                self.restored = True
            else:
                self.iterator = iter(self.dataset)
                self.restored = False

    @contextlib.contextmanager
    def _as_old(self) -> Iterator[None]:
        with self.streams.active(), _identity(*self.identity, self.seed, self.dataset):
            yield

    def __iter__(self) -> OldStream:
        return self

    def __next__(self) -> Any:
        with self._as_old():
            return next(self.iterator)

    def take(self, n: int) -> list[Any]:
        """Up to ``n`` next items (one switch of identity and RNG streams for all of them)."""
        with self._as_old():
            return list(islice(self.iterator, n))

    def skip(self, n: int) -> None:
        """Drop the next ``n`` items (at C speed, one switch)."""
        with self._as_old():
            consume(self.iterator, n)


def skip_delivered(iterator: Iterator[Any], delivered: int, digest: int, checks: Checks) -> Iterator[Any]:
    """Drop the ``delivered`` items a stream had delivered; the last one's digest must be the saved one."""
    if delivered > 0:
        if isinstance(iterator, OldStream):
            iterator.skip(delivered - 1)
        else:
            consume(iterator, delivered - 1)
        last = next(iterator, _END)
        if last is _END or item_digest(last) != int(digest):
            checks.replay_ok = False
    return iterator


_END = object()


def _old_worker(dataset: Any, base: int, epoch: int, grid: Grid, rank: int, worker: int,
                checks: Checks) -> Iterator[Any]:  # fmt: skip
    """What old (rank, worker) of ``grid`` had not delivered yet, in its order."""
    position = grid.positions[rank]
    delivered, digest = int(position["items"][worker]), int(position["digests"][worker])
    if grid.origin is not None:  # that grid was itself dealing an epoch from an earlier one
        own = share(remaining(dataset, base, epoch, grid.origin, checks), rank, grid, worker, checks)
        return skip_delivered(own, delivered, digest, checks)
    stream = OldStream(dataset, base, epoch, grid, rank, worker)
    return stream if stream.restored else skip_delivered(stream, delivered, digest, checks)


def _old_rank(streams: list[Iterator[Any]], first: int, batch: int, drop_last: bool) -> Iterator[list[Any]]:
    """An old rank's remaining batches in PyTorch's order.

    Its workers round-robin from ``first``, skipping the exhausted ones (a short batch is a worker's last).
    """
    due = deque((first + k) % len(streams) for k in range(len(streams)))
    while due:
        worker = due.popleft()
        stream = streams[worker]
        chunk = stream.take(batch) if isinstance(stream, OldStream) else list(islice(stream, batch))
        if len(chunk) == batch:
            due.append(worker)
        if chunk and (len(chunk) == batch or not drop_last):
            yield chunk


def remaining(dataset: Any, base: int, epoch: int, grid: Grid, checks: Checks) -> Iterator[Any]:
    """The items of ``grid``'s epoch not yet consumed, in the order the uninterrupted run would have consumed them."""
    ranks = []
    for rank, position in enumerate(grid.positions):
        streams = [_old_worker(dataset, base, epoch, grid, rank, w, checks) for w in range(grid.workers)]
        first = (int(position["last_worker"]) + 1) % grid.workers
        ranks.append(_old_rank(streams, first, grid.batch_size, grid.drop_last))
    while ranks:  # step by step: one batch of every rank that has one left
        alive = []
        for batches in ranks:
            chunk = next(batches, None)
            if chunk is not None:
                yield from chunk
                alive.append(batches)
        ranks = alive


def share(items: Iterator[Any], rank: int, grid: Layout, worker: int, checks: Checks) -> Iterator[Any]:
    """The items of ``items`` that (``rank``, ``worker``) of ``grid`` consumes.

    Every ``world``-th from ``rank``, in batches dealt round-robin to the workers (the module notes say what happens
    to the last, short round).
    """
    world, workers, batch = grid.world, grid.workers, grid.batch_size
    mine = 0  # items this rank has taken
    round_: list[Any] = []
    for item in items:
        round_.append(item)
        if len(round_) < world:
            continue
        own, round_ = round_[rank], []
        if (mine // batch) % workers == worker:
            yield own
        mine += 1
    if not round_ or grid.drop_last:
        return
    if rank < len(round_):
        own = round_[rank]
    elif mine % batch == 0:  # the ranks before opened a batch with their last item: this one must too (DDP)
        own = round_[rank % len(round_)]
        checks.padded += 1
    else:
        return
    if (mine // batch) % workers == worker:
        yield own


def elastic_items(dataset: Any, base: int, epoch: int, grid: Grid, rank: int, here: Layout,
                  worker: int, checks: Checks) -> Iterator[Any]:  # fmt: skip
    """What (``rank``, ``worker``) of the grid ``here`` consumes of ``grid``'s interrupted epoch."""
    return share(remaining(dataset, base, epoch, grid, checks), rank, here, worker, checks)


def exact_plans(remaining: list[Any], world: int, workers: int, batch: int, drop_last: bool) -> list[list[Any]]:
    """Litdata's per-worker plans (``(chunk, [items])`` visits) for the rest of an epoch, dealt as :func:`share`."""
    plans = []
    for rank in range(world):
        for worker in range(workers):
            visits: list[tuple[int, list[int]]] = []
            for chunk, item in share(iter(remaining), rank, Layout(world, workers, batch, drop_last), worker, Checks()):
                if visits and visits[-1][0] == chunk:
                    visits[-1][1].append(item)
                else:
                    visits.append((chunk, [item]))
            plans.append(visits)
    return plans


def layout_of(loader: Any, world: int) -> dict[str, Any]:
    """A converted stream loader's grid, as positions record it."""
    return {
        "world": int(world),
        "num_workers": int(loader.num_workers),
        "batch_size": loader.batch_size if loader.batch_sampler is not None else None,
        "drop_last": bool(loader.drop_last),
    }


def is_hf(dataset: Any) -> bool:
    """Whether ``dataset`` is a Hugging Face one.

    It takes its node when split (``split_dataset_by_node``), not while it runs: an old rank's stream is played from a
    copy split for that rank.
    """
    return type(dataset).__module__.startswith("datasets.")


__all__ = [
    "LAYOUT",
    "Checks",
    "Grid",
    "Layout",
    "OldStream",
    "elastic_items",
    "exact_plans",
    "is_hf",
    "layout_of",
    "remaining",
    "share",
]
