"""Iterable training data that resumes mid-epoch at the exact sample: the state protocol, or replay in the workers.

A training ``DataLoader`` over an ``IterableDataset`` is converted by the deterministic strategies like a map-style
one (:mod:`~lightning_determinism.data.resumable`), with a stream's own machinery:

- **Its own streams.** Each worker seeds python, numpy and torch at the start of every epoch from
  ``derive_seed(base, rank, "stream", worker, epoch)`` (and calls the dataset's ``set_epoch(epoch)`` when it has
  one); with ``num_workers=0`` the dataset draws from streams of its own, swapped in around each batch, so the data
  never depends on the random numbers the model drew. An epoch's stream is then a function of the seeds.
- **Each batch's collate of its own.** The loader's ``collate_fn`` runs under python, numpy and torch CPU streams
  seeded from ``derive_seed(base, rank, "collate", worker, epoch, n)``, ``n`` the items the worker delivered before
  the batch, and the worker's streams are put back after it: randomness drawn there (masking, as Hugging Face's
  ``DataCollatorForLanguageModeling`` does) is a function of the batch's place in its stream, so a restored or
  replayed worker draws it again without collating what it skips, and the stream's own items never depend on it.
- **Tagged batches.** In the worker, each batch leaves with the worker's id, its number of items, a digest of its
  last item and, for datasets with the state protocol, ``dataset.state_dict()`` plus the worker's RNG states; the
  main process strips the tag and keeps, per worker, what the training loop consumed (Lightning fetches one batch
  ahead: the position is taken at the consumed batch, not the fetched one).
- **Resume.** Each worker restores its position before it yields anything: ``load_state_dict(state)`` and its RNG
  states (O(1)) when the dataset has the protocol, else it replays its own stream from the epoch's seeds and drops
  the items it already delivered (no model compute), checking the last dropped item against the saved digest. The
  main process then hands out the workers' batches in the order of the uninterrupted run (PyTorch restarts its
  round-robin at worker 0; the interrupted epoch continued at another).

The state protocol: ``state_dict() -> dict`` (the position after the items yielded so far in this epoch, small,
plain values) and ``load_state_dict(state)`` (continue from there at the next ``iter``). Hugging Face's
``IterableDataset`` has it, but loses its shuffle buffer (datasets #7901): a shuffled one is replayed instead.
"""

from __future__ import annotations

import contextlib
import uuid
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from lightning_determinism._compat.data import hf_shards_in_turn
from lightning_determinism.data.elastic_streams import Checks, Grid, Layout, elastic_items, skip_delivered
from lightning_determinism.data.stream_state import (
    IsolatedStreams,
    collate_seed,
    has_state_protocol,
    item_digest,
    may_draw,
    seed_stream,
    seeded_streams,
    stream_seed,
)
from lightning_determinism.seeding.rng import capture_cpu_streams, restore_cpu_streams

HISTORY = 16
"""Batches fetched beyond the consumed ones that a position can still be taken back from (Lightning fetches one)."""


class _Active:
    """This process's copy of a stream in its epoch: what :class:`TagCollate` needs to tag and collate a batch."""

    __slots__ = ("dataset", "delivered", "keys", "stateful", "worker")

    def __init__(self, worker: int, dataset: Any, stateful: bool, keys: tuple[int, int, int], delivered: int) -> None:
        self.worker, self.dataset, self.stateful = worker, dataset, stateful
        self.keys = keys  # (base seed, rank, epoch): with the worker and `delivered`, its collate's seed
        self.delivered = delivered  # items delivered in this epoch (before the resume too)


_ACTIVE: dict[str, _Active] = {}
"""Per process: a stream's token -> its copy here (see :class:`_Active`)."""


class StreamPlan:
    """What every copy of a stream's dataset needs: seeds, the shared epoch and, for one epoch, where to resume.

    ``resume`` maps a worker to ``{"items": n, "digest": d, "state": s}``: its delivered items, the digest of the
    last one and, with the state protocol, ``{"dataset": ..., "rng": ...}`` after it. ``elastic`` (the positions of
    every rank of an earlier grid) makes the resumed epoch the rest of that grid's epoch (:mod:`.elastic_streams`).
    """

    def __init__(self, base_seed: int, rank: int) -> None:
        self.token = uuid.uuid4().hex
        self.base_seed, self.rank = int(base_seed), int(rank)
        self.layout: dict[str, Any] = {}  # the loader's grid (elastic_streams.layout_of), set at each iterator
        self.epoch = torch.zeros((), dtype=torch.int64).share_memory_()
        self.resume_epoch = -1
        self.resume: dict[int, dict[str, Any]] = {}
        self.elastic: list[dict[str, Any]] | None = None


class StreamProxy(IterableDataset):  # type: ignore[type-arg]
    """Stands in for the user's dataset while a converted loader creates its iterator (see the module notes)."""

    def __init__(self, dataset: Any, plan: StreamPlan, batched: bool, isolated: IsolatedStreams | None) -> None:
        self.dataset, self.plan, self.batched = dataset, plan, batched
        self.isolated = isolated  # num_workers=0: the main process's private streams (not sent to workers)
        self.stateful = has_state_protocol(dataset)
        self._resumed: set[int] = set()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "isolated": None}

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        epoch = int(self.plan.epoch)
        context = self.isolated.active() if info is None and self.isolated is not None else contextlib.nullcontext()
        with context, hf_shards_in_turn(self.dataset):
            seed_stream(stream_seed(self.plan.base_seed, self.plan.rank, worker, epoch), self.dataset, epoch)
            resume = None
            if epoch == self.plan.resume_epoch and epoch not in self._resumed:
                self._resumed.add(epoch)
                resume = self.plan.resume.get(worker)
            checks = Checks()
            elastic = resume is not None and self.plan.elastic is not None
            if elastic:  # the rest of an earlier grid's epoch (a replay: no state travels with its batches)
                layout = self.plan.layout
                here = Layout(layout["world"], max(1, info.num_workers if info else 0), layout["batch_size"] or 1,
                              layout["drop_last"])  # fmt: skip
                grid = Grid(self.plan.elastic)  # type: ignore[arg-type]
                items = elastic_items(self.dataset, self.plan.base_seed, epoch, grid, self.plan.rank, here, worker,
                                      checks)  # fmt: skip
                iterator = skip_delivered(items, int(resume["items"]), int(resume["digest"]), checks)  # type: ignore[index]
            elif resume is not None and resume.get("state") is not None and self.stateful:
                self.dataset.load_state_dict(resume["state"]["dataset"])
                iterator = iter(self.dataset)
                restore_cpu_streams(resume["state"]["rng"])
            else:
                iterator = iter(self.dataset)
                if resume is not None:
                    skip_delivered(iterator, int(resume["items"]), int(resume["digest"]), checks)
        delivered = int(resume["items"]) if resume is not None else 0
        keys = (self.plan.base_seed, self.plan.rank, epoch)
        _ACTIVE[self.plan.token] = _Active(worker, self.dataset, self.stateful and not elastic, keys, delivered)
        if resume is not None:
            _CHECKS[self.plan.token] = checks
        if type(self.dataset).__module__.startswith("datasets."):
            return _in_turn(iterator, self.dataset)
        return iterator


def _in_turn(iterator: Iterator[Any], dataset: Any) -> Iterator[Any]:
    """``iterator``, each item drawn with Hugging Face's shards read in turn (``_compat.data.hf_shards_in_turn``)."""
    while True:
        with hf_shards_in_turn(dataset):
            item = next(iterator, _END)
        if item is _END:
            return
        yield item


_END = object()


_CHECKS: dict[str, Checks] = {}
"""Per process: a resumed stream's checks (the replay's digest check, at once; items repeated for DDP, at the end of
its epoch), sent with the batches that follow them (:meth:`TagCollate.__call__`)."""


def _news(token: str) -> tuple[bool, int] | None:
    """What a resumed stream's checks found since the last batch, if anything."""
    checks = _CHECKS.get(token)
    if checks is None or (checks.replay_ok and not checks.padded):
        return None
    news = (checks.replay_ok, checks.padded)
    checks.replay_ok, checks.padded = True, 0  # each finding is sent once
    return news


class Tagged:
    """A batch on its way from a worker, with what the main process needs to know about it."""

    __slots__ = ("checks", "data", "digest", "items", "state", "worker")

    def __init__(self, worker: int, items: int, digest: int, state: Any, checks: tuple[bool, int] | None, data: Any):
        self.worker, self.items, self.digest, self.state, self.checks, self.data = (
            worker,
            items,
            digest,
            state,
            checks,
            data,
        )

    def pin_memory(self) -> Tagged:
        """Pin the batch, not the tag (PyTorch's pin-memory thread calls this)."""
        return Tagged(self.worker, self.items, self.digest, self.state, self.checks, _pinned(self.data))


def _pinned(data: Any) -> Any:
    if isinstance(data, torch.Tensor):
        return data.pin_memory()
    if isinstance(data, dict):
        return type(data)({key: _pinned(value) for key, value in data.items()})
    if isinstance(data, tuple) and type(data) is not tuple:  # a namedtuple
        return type(data)(*(_pinned(value) for value in data))
    if isinstance(data, (list, tuple)):
        return type(data)(_pinned(value) for value in data)
    pin = getattr(data, "pin_memory", None)
    return pin() if callable(pin) else data


class TagCollate:
    """The ``collate_fn`` a converted stream loader's iterator runs: the user's, under its batch's seed, and a tag."""

    def __init__(self, inner: Any, token: str, batched: bool) -> None:
        self.inner, self.token, self.batched = inner, token, batched
        self.draws = may_draw(inner)

    def __call__(self, items: Any) -> Tagged:
        """Collate ``items`` as the user's function does and tag the batch (in the worker)."""
        active = _ACTIVE[self.token]
        count = len(items) if self.batched else 1
        digest = item_digest(items[-1] if self.batched else items)
        stateful = active.stateful
        state = {"dataset": active.dataset.state_dict(), "rng": capture_cpu_streams()} if stateful else None
        if self.draws:
            base, rank, epoch = active.keys
            with seeded_streams(collate_seed(base, rank, active.worker, epoch, active.delivered)):
                data = self.inner(items)
        else:
            data = self.inner(items)
        active.delivered += count
        return Tagged(active.worker, count, digest, state, _news(self.token), data)


class StreamPosition:
    """Per worker, what the training loop consumed of one epoch's stream, taken back over batches fetched ahead."""

    def __init__(self, workers: int, saved: dict[str, Any] | None = None, layout: dict[str, Any] | None = None) -> None:
        self.workers = workers
        self.layout = layout or {}  # the grid (elastic_streams.LAYOUT) and the earlier grid it deals from, if any
        saved = saved or {}
        self.items = [int(n) for n in saved.get("items", [0] * workers)]
        self.digests = [int(d) for d in saved.get("digests", [0] * workers)]
        self.states: list[Any] = list(saved.get("states", [None] * workers))
        self.last_worker = int(saved.get("last_worker", -1))
        self.batches = self.saved_batches = int(saved.get("batches", 0))
        self._undo: deque[tuple[int, int, int, Any, int]] = deque(maxlen=HISTORY)

    def add(self, tag: Tagged) -> None:
        """Count a batch fetched from the stream."""
        w = tag.worker
        self._undo.append((w, tag.items, self.digests[w], self.states[w], self.last_worker))
        self.items[w] += tag.items
        self.digests[w], self.states[w], self.last_worker = tag.digest, tag.state, w
        self.batches += 1

    def at(self, consumed: int) -> dict[str, Any]:
        """The position after ``consumed`` batches of the epoch (``consumed`` <= batches fetched)."""
        ahead = self.batches - consumed
        if ahead < 0 or ahead > len(self._undo):
            raise RuntimeError(
                f"the stream's position is known for batches {self.batches - len(self._undo)} to {self.batches} of"
                f" the epoch, not after batch {consumed}"
            )
        items, digests, states, last = list(self.items), list(self.digests), list(self.states), self.last_worker
        for w, count, digest, state, previous in list(self._undo)[len(self._undo) - ahead :][::-1]:
            items[w] -= count
            digests[w], states[w], last = digest, state, previous
        return {
            **self.layout,
            "workers": self.workers,
            "items": items,
            "digests": digests,
            "states": states,
            "last_worker": last,
            "batches": consumed,
        }


class StreamIterator:
    """The main-process side: strips tags, keeps the position, and restores the uninterrupted run's batch order.

    PyTorch hands out the batches of an iterable dataset round-robin over the workers, from worker 0, skipping
    exhausted workers. A resumed epoch must continue at worker ``first`` instead: batches are held back (at most
    one per worker) until the one due arrives, or until a later one shows that the worker due is exhausted.
    """

    def __init__(
        self, inner: Iterator[Any], position: StreamPosition, first: int, isolated: IsolatedStreams | None
    ) -> None:
        self.inner, self.position, self.isolated = inner, position, isolated
        self.workers = position.workers
        self._due = first  # the worker whose batch comes next (resumed epoch), else None: PyTorch's order
        self._reorder = first != 0
        self._held: dict[int, deque[tuple[int, Tagged]]] = {w: deque() for w in range(self.workers)}
        self._received = [0] * self.workers  # batches received per worker in this iterator
        self._done = [False] * self.workers
        self._exhausted_inner = False
        self.replay_failures: list[int] = []
        self.padded = 0  # items repeated so that every rank has as many batches (elastic resume)

    def __iter__(self) -> StreamIterator:
        return self

    def _pull(self) -> Tagged | None:
        if self._exhausted_inner:
            return None
        try:
            if self.isolated is not None:
                with self.isolated.active():
                    tag = next(self.inner)
            else:
                tag = next(self.inner)
        except StopIteration:
            self._exhausted_inner = True
            return None
        if not isinstance(tag, Tagged):
            raise TypeError(f"a converted stream loader produced an untagged batch: {type(tag).__name__}")
        if tag.checks is not None:
            if not tag.checks[0]:
                self.replay_failures.append(tag.worker)
            self.padded += tag.checks[1]
        return tag

    def __next__(self) -> Any:
        tag = self._pull() if not self._reorder else self._next_in_order()
        if tag is None:
            raise StopIteration
        self.position.add(tag)
        return tag.data

    def _next_in_order(self) -> Tagged | None:
        while True:
            if all(self._done) and not any(self._held.values()):
                return None
            due = self._due
            if self._done[due] and not self._held[due]:
                self._due = (due + 1) % self.workers
                continue
            if self._held[due]:
                self._due = (due + 1) % self.workers
                return self._held[due].popleft()[1]
            tag = self._pull()
            if tag is None:  # every worker has delivered everything it will
                self._done = [True] * self.workers
                continue
            w = tag.worker
            order = (self._received[w], w)  # its place in PyTorch's round-robin
            self._received[w] += 1
            self._held[w].append((order[0], tag))
            if w != due and order > (self._received[due], due):
                self._done[due] = not self._held[due]  # PyTorch skipped the worker due: it is exhausted
