"""Training data loaders that resume mid-epoch, bitwise, skipping consumed batches at the index level.

Resumed mid-epoch, Lightning iterates a plain ``DataLoader`` again from the epoch's first batch, and the new iterator
draws a new shuffle and new worker seeds. Under the deterministic strategies every training ``DataLoader`` is made
resumable instead (its class becomes a subclass of its own with the methods of :class:`ResumableLoaderMixin`):

- its iterator is created lazily, at the first batch, so the random numbers it draws are drawn at the same point of
  the run whether or not the run was resumed (Lightning creates iterators early, e.g. for
  ``estimated_stepping_batches``);
- at each creation it remembers the RNG states the creation draws from (python, numpy and torch CPU streams, the
  loader's and the sampler's generators): the epoch's order is a function of them;
- a checkpoint (:class:`~lightning_determinism.RNGStateCheckpoint`) keeps, per rank and loader, these states and
  the number of batches the training loop consumed;
- the resumed run creates its first iterator from the saved states, drops the consumed batches' indices before any
  sample is read, then puts back the RNG states restored from the checkpoint, so everything after continues as in
  the uninterrupted run.

A saved position that cannot be resumed here is refused, or warned about, before the first batch
(:mod:`~lightning_determinism.data._resume_checks`).

Randomness drawn inside data-loader workers lives in processes that cannot be checkpointed: with ``num_workers > 0``
the workers of a resumed iterator take over the roles of the uninterrupted run's and replay their earlier fetches
(:mod:`~lightning_determinism.data._worker_replay`), unless :class:`~lightning_determinism.WorkerSeedCallback`
``(per_sample=True)`` seeds every sample by its index (no replay needed). Persistent workers past their first epoch
carry their states over from the epochs before: warned.

Every loader the strategies process (evaluation loaders too) also survives CPython's fork deadlock gh-112275
(:mod:`~lightning_determinism.data._worker_start`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch.utils.data import DataLoader, IterableDataset

from lightning_determinism._compat.checks import set_sampler_epoch
from lightning_determinism._compat.data import base_index_sampler, loader_iterator
from lightning_determinism.data import deal as deals
from lightning_determinism.data._index_skip import DealtOnce, SkipOnce, prime
from lightning_determinism.data._resume_checks import check_deal, check_shape, warn_if_not_bitwise
from lightning_determinism.data._worker_replay import RoleWorkerInit, WorkerReplay, consumed_indices
from lightning_determinism.data._worker_start import create_iterator
from lightning_determinism.data.fabric_epoch import FabricEpochIterator
from lightning_determinism.data.positions import current_epoch, is_converted, peek_resume, take_resume
from lightning_determinism.data.stateful import is_stateful_loader, make_stateful
from lightning_determinism.data.stream_loader import create_stream_iterator
from lightning_determinism.seeding.rng import capture_cpu_streams, restore_cpu_streams


class _LazyIterator:
    """The iterator a resumable loader returns: the real one is created at the first batch."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader
        self._iterator: Iterator[Any] | None = None

    def __iter__(self) -> _LazyIterator:
        return self

    def __next__(self) -> Any:
        if self._iterator is None:
            self._iterator = self._loader._ldet_create_iterator()
        return next(self._iterator)

    def __len__(self) -> int:
        return len(self._loader)  # type: ignore[arg-type]


class ResumableLoaderMixin:
    """The methods a converted ``DataLoader`` gains (:func:`make_resumable` for training, :func:`make_fork_safe`).

    They are copied into a direct subclass of the loader's own class rather than mixed in as a base: ``__class__``
    assignment needs the same layout, which a second base would change. The loader's own class is the converted
    class's only base, reached with ``_ldet_base``.
    """

    _ldet_trainer: Any
    _ldet_resumable: bool
    _ldet_epoch_start: dict[str, Any] | None
    _ldet_skip: int | None  # batches to drop while a resumed iterator is being created, else None
    _ldet_skip_sampler: SkipOnce | None
    _ldet_order: list[int] | None  # a dealt rest of an epoch the next iterator serves first (see data.deal)
    _ldet_dealt: dict[str, Any] | None  # the deal the current epoch was dealt by, for the next checkpoint
    _ldet_deal_checked: dict[str, Any] | None  # the saved deal already checked (and said) before its first batch

    def __iter__(self) -> Iterator[Any]:
        epoch = getattr(self, "_ldet_epoch", None)
        if epoch is not None:  # Fabric: a loader's epoch is the number of times it was iterated (see .fabric)
            epoch.fill_(self._ldet_iterations)  # type: ignore[attr-defined]
            self._ldet_iterations += 1  # type: ignore[attr-defined]
        if self._ldet_resumable:
            if self._ldet_trainer() is None:  # Fabric; under a Trainer, load_state_dict checks (see there)
                check_deal(self, peek_resume(None, self))
            if epoch is not None and not getattr(self, "_ldet_stream", False):  # Fabric: the loop's draws counted
                return FabricEpochIterator(self, lambda: _LazyIterator(self))
            return _LazyIterator(self)  # type: ignore[arg-type]
        return self._ldet_fork(self._ldet_base().__iter__.__get__(self))

    def _ldet_base(self) -> Any:
        return type(self).__bases__[0]

    def _ldet_fork(self, create: Any) -> Any:
        """``create()`` the iterator; fork its workers again if one is stuck (see the module notes)."""
        return create_iterator(self, create)

    @property
    def _index_sampler(self) -> Any:
        inner = base_index_sampler(self._ldet_base(), self)
        if getattr(self, "_ldet_order", None) is not None:
            if self._ldet_skip_sampler is None or self._ldet_skip_sampler.inner is not inner:
                self._ldet_skip_sampler = DealtOnce(inner, self._ldet_order)  # type: ignore[arg-type]
            return self._ldet_skip_sampler
        if self._ldet_skip is not None:
            if self._ldet_skip_sampler is None or self._ldet_skip_sampler.inner is not inner:
                self._ldet_skip_sampler = SkipOnce(inner, self._ldet_skip)
            return self._ldet_skip_sampler
        return inner

    # Lightning's `_Stateful` protocol: with it Lightning no longer warns that the loader cannot resume; the position
    # itself travels in RNGStateCheckpoint's entry, which Lightning's #20550 cannot drop.
    def state_dict(self) -> dict[str, Any]:
        """A marker for Lightning: the loader's position is kept by ``RNGStateCheckpoint``."""
        return {"position": "kept by lightning_determinism.RNGStateCheckpoint"}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The position is restored from ``RNGStateCheckpoint``'s entry; one that cannot be dealt here is refused.

        Lightning calls this on a restart once the loaders are set up, before it creates their iterators: an error
        here ends the run before training, cleanly (one raised from ``__iter__`` breaks Lightning's teardown, one at
        the first batch comes after the hooks that start training).
        """
        check_deal(self, peek_resume(self._ldet_trainer(), self))

    def _ldet_snapshot(self, fresh: bool) -> dict[str, Any]:
        state = {**capture_cpu_streams(), "fresh": int(fresh)}
        generator = getattr(self, "generator", None)
        if generator is not None:
            state["loader_generator"] = generator.get_state()
        sampler_generator = getattr(getattr(self, "sampler", None), "generator", None)
        if isinstance(sampler_generator, torch.Generator):
            state["sampler_generator"] = sampler_generator.get_state()
        return state

    def _ldet_restore(self, state: dict[str, Any]) -> None:
        restore_cpu_streams(state)
        generator = getattr(self, "generator", None)
        if generator is not None and "loader_generator" in state:
            generator.set_state(state["loader_generator"])
        sampler_generator = getattr(getattr(self, "sampler", None), "generator", None)
        if isinstance(sampler_generator, torch.Generator) and "sampler_generator" in state:
            sampler_generator.set_state(state["sampler_generator"])

    def _ldet_fresh(self) -> bool:
        """Whether ``DataLoader.__iter__`` builds a new iterator (drawing worker seeds) or resets a persistent one."""
        return not (getattr(self, "persistent_workers", False) and loader_iterator(self) is not None)

    def _ldet_set_epoch(self, epoch: int) -> None:
        set_sampler_epoch(self, epoch)
        per_sample = getattr(getattr(self, "dataset", None), "__getitems__", None)
        shared_epoch = getattr(per_sample, "epoch", None)  # WorkerSeedCallback's per-sample epoch, if installed
        if isinstance(shared_epoch, torch.Tensor):
            shared_epoch.fill_(epoch)

    def _ldet_create_iterator(self) -> Iterator[Any]:
        trainer = self._ldet_trainer()
        resume = take_resume(trainer, self)
        # The loader's own class (DataLoader or the user's subclass of it), forking safely.
        parent_iter = self._ldet_base().__iter__.__get__(self)

        def create() -> Any:
            return self._ldet_fork(parent_iter)

        if getattr(self, "_ldet_stream", False):
            return self._ldet_create_stream(trainer, resume, create)
        self._ldet_dealt = None
        if resume is None:
            self._ldet_set_epoch(_loader_epoch(self, trainer))
            self._ldet_epoch_start = self._ldet_snapshot(self._ldet_fresh())
            return create()  # type: ignore[no-any-return]
        deal = resume.get("deal")
        if deal is not None and deals.needs_deal(deal, self):
            return self._ldet_deal(deal, int(resume["epoch"]), create, resume.get("epoch_start"))
        self._ldet_set_epoch(int(resume["epoch"]))
        start = resume.get("epoch_start")
        skip = int(resume.get("skip", 0))
        if skip and resume.get("shape") is not None:
            check_shape(resume["shape"], self, skip, int(resume["epoch"]))
        if start is None:
            # The epoch had not begun when the checkpoint was written; or the order depends on no RNG state (the
            # world-size-invariant sampler, resumed on another world size): skip without restoring states.
            self._ldet_epoch_start = self._ldet_snapshot(self._ldet_fresh())
            self._ldet_skip = skip if skip else None
            try:
                iterator = create()
                prime(iterator)
                return iterator  # type: ignore[no-any-return]
            finally:
                self._ldet_skip = None
                self._ldet_skip_sampler = None
        now = self._ldet_snapshot(True)
        self._ldet_restore(start)
        self._ldet_epoch_start = start
        replay = self._ldet_worker_replay(start, skip, parent_iter)  # restores `start` again after its draws
        self._ldet_skip = skip
        generator: Any = getattr(self, "generator", None)
        if not start.get("fresh", 1):
            # The original epoch reset persistent workers (no worker-seed draw); this fresh iterator draws one:
            # let a throwaway generator take it, so the sampler's draw sees the saved state.
            self.generator = torch.Generator()
        init = self.worker_init_fn  # type: ignore[attr-defined,has-type]
        if replay is not None:
            self.worker_init_fn = RoleWorkerInit(init, replay)
        try:
            iterator = create()
            prime(iterator)
            return iterator  # type: ignore[no-any-return]
        finally:
            self.worker_init_fn = init
            self.generator = generator
            self._ldet_skip = None
            self._ldet_skip_sampler = None
            self._ldet_restore(now)

    def _ldet_deal(
        self, deal: dict[str, Any], epoch: int, create: Any, start: dict[str, Any] | None = None
    ) -> Iterator[Any]:
        """Serve this replica's share of the rest of an epoch interrupted on another number of replicas.

        ``start``: the dealt epoch's RNG states where the checkpoint was written inside it on this layout; the
        iterator is created from them (its creation draws what the uninterrupted run's drew), then the states
        restored from the checkpoint are put back.
        """
        check_deal(self, {"deal": deal, "epoch": epoch})  # if it was not checked before the first batch
        self._ldet_set_epoch(epoch)
        now = self._ldet_snapshot(True)
        if start is not None:
            self._ldet_restore(start)
        self._ldet_epoch_start = start if start is not None else self._ldet_snapshot(self._ldet_fresh())
        self._ldet_order = deals.share_of(deal, self, epoch)
        self._ldet_dealt = deal
        try:
            iterator = create()
            prime(iterator)
            return iterator  # type: ignore[no-any-return]
        finally:
            self._ldet_order = None
            self._ldet_skip_sampler = None
            if start is not None:
                self._ldet_restore(now)

    def _ldet_worker_replay(self, start: dict[str, Any], skip: int, create_single: Any) -> WorkerReplay | None:
        """With workers and no per-sample seeds: the replay that gives each worker its role (``_worker_replay``)."""
        workers = int(getattr(self, "num_workers", 0))
        getitems = getattr(getattr(self, "dataset", None), "__getitems__", None)
        if not workers or not skip or getattr(getitems, "ldet_per_sample", False):
            return None  # nothing drawn in workers, nothing consumed, or every sample seeded by its index
        if not start.get("fresh", 1) or (getattr(self, "persistent_workers", False) and skip % workers):
            warn_if_not_bitwise(self)  # persistent workers: their states carry over from the epochs before
            return None
        batches = consumed_indices(self, create_single, skip)
        self._ldet_restore(start)
        rank_zero_info(
            f"Resuming mid-epoch: the {workers} data-loader workers replay the {skip} batches consumed before the"
            " checkpoint (their per-worker random streams); WorkerSeedCallback(per_sample=True) resumes in O(1)."
        )
        return WorkerReplay(skip, workers, batches, self.collate_fn, self.batch_sampler is not None)  # type: ignore[attr-defined]

    def _ldet_create_stream(self, trainer: Any, resume: dict[str, Any] | None, create: Any) -> Iterator[Any]:
        """An iterable dataset's iterator (see :mod:`~lightning_determinism.data.streams`).

        Resumed from a stream epoch's last batch, Lightning starts the next epoch without resetting its batch counter
        or counting the epoch as started (it compares the counter with an infinite length): the stream keeps its
        own epoch and counts its batches from the loop's counter at its creation.
        """
        pending = getattr(self, "_ldet_pending", None)
        if resume is None and pending is not None:
            # Lightning 2.5 creates the training iterator twice when it restarts: the first one, which took the
            # resume, is dropped before a batch of it is trained on. The second resumes at the same position.
            resume = pending
        iterator = self._ldet_new_stream(trainer, resume, create)
        self._ldet_pending = resume if trainer is not None and resume is not None else None
        self._ldet_counter_base = None  # set at the first training batch from this iterator (see mark_stream_start)
        return iterator

    def _ldet_new_stream(self, trainer: Any, resume: dict[str, Any] | None, create: Any) -> Iterator[Any]:
        if resume is None:
            epoch = _loader_epoch(self, trainer)
            self._ldet_set_epoch(epoch)
            return create_stream_iterator(self, trainer, epoch, None, create)  # type: ignore[no-any-return]
        epoch = int(resume["epoch"])
        self._ldet_set_epoch(epoch)
        reused = bool(getattr(self, "persistent_workers", False)) and epoch > 0  # its workers, created at epoch 0
        if resume.get("stream") is None and not reused:  # an epoch's start: the uninterrupted run created one here too
            return create_stream_iterator(self, trainer, epoch, None, create)  # type: ignore[no-any-return]
        now = self._ldet_snapshot(True)  # what creating the iterator draws, the uninterrupted run drew at epoch start
        try:
            stream, grid = resume.get("stream"), resume.get("grid")
            return create_stream_iterator(self, trainer, epoch, stream, create, grid)  # type: ignore[no-any-return]
        finally:
            self._ldet_restore(now)


def _loader_epoch(loader: Any, trainer: Any) -> int:
    if trainer is not None:
        return current_epoch(trainer)
    epoch = getattr(loader, "_ldet_epoch", None)  # Fabric: the number of earlier iterations (set by __iter__)
    return int(epoch) if epoch is not None else 0


_CLASSES: dict[type, type] = {}
_SKIP = {"__dict__", "__weakref__", "__module__", "__qualname__", "__doc__", "__annotations__"}


def _resumable_class(cls: type) -> type:
    if cls not in _CLASSES:
        methods = {name: value for name, value in vars(ResumableLoaderMixin).items() if name not in _SKIP}
        _CLASSES[cls] = type(
            f"Resumable{cls.__name__}", (cls,), {**methods, "__module__": __name__, "_ldet_converted": True}
        )
    return _CLASSES[cls]


def _is_torchdata_stateful(dataloader: object) -> bool:
    cls = type(dataloader)
    return cls.__name__ == "StatefulDataLoader" and cls.__module__.startswith("torchdata")


def _convert(dataloader: DataLoader, trainer: Any, resumable: bool) -> DataLoader:
    if not is_converted(dataloader):
        dataloader.__class__ = _resumable_class(type(dataloader))
        dataloader._ldet_epoch_start = None  # type: ignore[attr-defined]
        dataloader._ldet_skip = None  # type: ignore[attr-defined]
        dataloader._ldet_skip_sampler = None  # type: ignore[attr-defined]
        dataloader._ldet_order = None  # type: ignore[attr-defined]
        dataloader._ldet_dealt = None  # type: ignore[attr-defined]
        dataloader._ldet_deal_checked = None  # type: ignore[attr-defined]
    dataloader._ldet_resumable = resumable  # type: ignore[attr-defined]
    dataloader._ldet_trainer = weakref.ref(trainer) if trainer is not None else (lambda: None)  # type: ignore[attr-defined]
    return dataloader


def make_fork_safe(dataloader: object, trainer: Any = None) -> object:
    """Let a ``DataLoader`` fork its workers again when one is stuck at start (see ``_worker_start``).

    Examples:
        >>> loader = make_fork_safe(DataLoader(range(4), batch_size=2))
        >>> [batch.tolist() for batch in loader]
        [[0, 1], [2, 3]]
    """
    if not isinstance(dataloader, DataLoader) or is_stateful_loader(dataloader):
        return dataloader  # a loader with a state of its own (litdata) creates its workers itself
    resumable = bool(getattr(dataloader, "_ldet_resumable", False))
    return _convert(dataloader, trainer, resumable)


def make_resumable(dataloader: object, trainer: Any) -> object:
    """Make a training ``DataLoader`` resumable mid-epoch (in place: its class gains the mixin).

    A loader with a state of its own (litdata's ``StreamingDataLoader``) keeps it (:mod:`.data.stateful`); one over an
    ``IterableDataset`` resumes at the exact sample (:mod:`.data.streams`). Anything that is not a ``DataLoader`` is
    returned unchanged: it restarts an interrupted epoch at its first batch, with a warning at resume.

    Raises:
        RuntimeError: for torchdata's ``StatefulDataLoader``, whose own resume breaks under Lightning's DDP.
    """
    if _is_torchdata_stateful(dataloader):
        raise RuntimeError(
            "torchdata's StatefulDataLoader is not supported by the deterministic strategies: under Lightning's DDP"
            " its RandomSampler (not a subclass of torch's) gets wrapped in DistributedSamplerWrapper, whose shards"
            " overlap when ranks seed differently, and its StatefulDistributedSampler saves no epoch, so with workers"
            " an interrupted epoch resumes in epoch 0's order. Pass a plain torch.utils.data.DataLoader: the"
            " strategies make it resume mid-epoch, bitwise (see docs/resume.md)."
        )
    if not isinstance(dataloader, DataLoader):
        return dataloader
    if is_stateful_loader(dataloader):
        return make_stateful(dataloader, trainer)
    converted = _convert(dataloader, trainer, resumable=True)
    converted._ldet_stream = isinstance(dataloader.dataset, IterableDataset)  # type: ignore[attr-defined]
    return converted


__all__ = ["ResumableLoaderMixin", "make_fork_safe", "make_resumable"]
