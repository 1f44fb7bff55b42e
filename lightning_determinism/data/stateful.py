"""Loaders that keep their own position (litdata's ``StreamingDataLoader``): their state, taken at the right batch.

A ``DataLoader`` subclass with ``state_dict()`` / ``load_state_dict()`` of its own knows its position better than
anyone; the deterministic strategies leave its iterator, workers and sampling alone and only fix what goes wrong
around it under Lightning:

- Lightning saves the loader's ``state_dict()`` while it has already fetched the next batch (its fetcher runs one
  batch ahead), so a resumed run skips that batch. The converted loader records its state after every batch it
  delivers and :class:`~lightning_determinism.RNGStateCheckpoint` saves the one of the last *consumed* batch, per
  rank; Lightning's own copy is not loaded back (``load_state_dict`` ignores calls while converted).
- At an epoch boundary there is no mid-epoch state to load: a loader that counts epochs itself (``current_epoch``,
  litdata's shuffle seed) gets its counter back instead.
- Resumed mid-epoch, creating the iterator draws a worker seed from the main process's RNG at a point where the
  uninterrupted run drew none: the RNG states are put back after the first batch.
- On another grid (world size, ``num_workers``, batch size), litdata restripes the rest of the epoch itself; the
  deterministic strategies make it deal the rest at the exact sample (``_compat_data.litdata_exact_restripe``) and
  let Lightning count that epoch's batches anew. A checkpoint written during such an epoch keeps the state it was
  loaded from: resumed on the same grid, the epoch is planned again from it and the batches already consumed are
  read and dropped (litdata would start its workers' round-robin at the first worker there).
- litdata's default ``drop_last`` follows the world size (``True`` on 2 or more ranks, ``False`` on one), and litdata
  refuses a state whose ``drop_last`` is not the dataset's: on another world size that difference is accepted (the
  interrupted epoch stays planned as its grid planned it, ``_compat_data.litdata_default_drop_last``) and the states
  taken during that epoch keep the planning value; any other difference is refused at resume, in one line.
"""

from __future__ import annotations

import copy
import weakref
from collections import deque
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader

from lightning_determinism._compat.data import litdata_exact_restripe, litdata_planned_drop_last, litdata_state_for
from lightning_determinism.data.elastic_streams import exact_plans
from lightning_determinism.data.positions import is_stateful_loader, take_resume
from lightning_determinism.data.streams import HISTORY  # batches kept to take a position back (fetched ahead)
from lightning_determinism.seeding.rng import capture_cpu_streams, restore_cpu_streams


def _base(loader: Any) -> Any:
    """The loader's own class (the converted class's only base)."""
    return type(loader).__bases__[0]


class _StatefulIterator:
    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.inner: Iterator[Any] | None = None

    def __iter__(self) -> _StatefulIterator:
        return self

    def __next__(self) -> Any:
        loader = self.loader
        base: Any = type(loader).__bases__[0]
        if self.inner is None:
            resume = loader._ldet_take_resume()
            if resume is not None and resume.get("loader_state") is not None:
                state, skip = resume["loader_state"], 0
                if resume.get("origin") is not None:  # an epoch restriped from another grid: again from its start
                    state, skip = resume["origin"], int(resume["batches"])
                litdata_exact_restripe(exact_plans)  # on another grid: at the exact sample (see there)
                state = litdata_state_for(loader, state)
                loader._ldet_load(state)
                # A copy: litdata updates the state it loaded in place with every state_dict() it returns.
                loader._ldet_origin = copy.deepcopy(state) if resume.get("elastic") or skip else None
                now = capture_cpu_streams()
                self.inner = iter(base.__iter__(loader))
                loader._ldet_history.clear()
                loader._ldet_epoch_done = False
                try:
                    for _ in range(skip):  # the batches of that epoch consumed before the checkpoint
                        next(self.inner)
                    batch = next(self.inner)
                finally:
                    restore_cpu_streams(now)  # what creating the iterator drew, the uninterrupted run did not
                loader._ldet_batches = int(resume["batches"])
                return self._delivered(batch)
            if resume is not None and resume.get("loader_epoch") is not None and hasattr(loader, "current_epoch"):
                loader.current_epoch = int(resume["loader_epoch"])
            if getattr(loader, "restore", False) is True:
                loader.restore = False  # litdata: left set by a resumed epoch whose generator was not run to its end
            loader._ldet_epoch_before = int(getattr(loader, "current_epoch", 0))
            loader._ldet_origin = None
            loader._ldet_history.clear()
            loader._ldet_batches = 0
            loader._ldet_epoch_done = False
            self.inner = iter(base.__iter__(loader))
        try:
            batch = next(self.inner)
        except StopIteration:
            loader._ldet_epoch_done = True
            raise
        return self._delivered(batch)

    def _delivered(self, batch: Any) -> Any:
        loader = self.loader
        loader._ldet_batches += 1
        state = _base(loader).state_dict(loader)
        if loader._ldet_origin is not None:  # litdata's default drop_last on another world size: the planning one
            state = litdata_planned_drop_last(state, loader._ldet_origin)
        loader._ldet_history.append((loader._ldet_batches, state))
        return batch


class StatefulLoaderMixin:
    """The methods a converted stateful loader gains (copied into a direct subclass, as for the resumable loaders)."""

    _ldet_history: deque[tuple[int, dict[str, Any]]]
    _ldet_batches: int
    _ldet_epoch_before: int
    _ldet_loading: bool
    _ldet_origin: dict[str, Any] | None  # the state an epoch restriped from another grid was loaded from
    _ldet_trainer: Any

    def __iter__(self) -> Iterator[Any]:
        return _StatefulIterator(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Under the Trainer, ignored: the position comes from ``RNGStateCheckpoint``'s entry (see the module notes)."""
        if self._ldet_loading or self._ldet_trainer() is None:  # Fabric: no fetcher runs ahead, the user's call counts
            _base(self).load_state_dict(self, state_dict)

    def _ldet_load(self, state: dict[str, Any]) -> None:
        self._ldet_loading = True
        try:
            self.load_state_dict(state)
        finally:
            self._ldet_loading = False

    def _ldet_take_resume(self) -> dict[str, Any] | None:

        return take_resume(self._ldet_trainer(), self)

    def _ldet_position_at(self, consumed: int, finished: bool) -> dict[str, Any]:
        """The position to save after ``consumed`` batches of the epoch, or at the next epoch's start (``finished``)."""
        if finished or consumed == 0:
            epoch = getattr(self, "current_epoch", None) if finished else self._ldet_epoch_before
            return {"loader_epoch": None if epoch is None else int(epoch), "batches": 0}
        for batches, state in self._ldet_history:
            if batches == consumed:
                return {"loader_state": state, "batches": consumed, "origin": self._ldet_origin}
        raise RuntimeError(
            f"the state of `{type(self).__name__}` after batch {consumed} of the epoch is no longer known (kept: the"
            f" last {HISTORY} delivered batches, up to {self._ldet_batches})"
        )


_CLASSES: dict[type, type] = {}


def make_stateful(loader: DataLoader, trainer: Any) -> DataLoader:
    """Convert a stateful loader in place (its class becomes a direct subclass of its own with the mixin's methods)."""
    cls = type(loader)
    if not getattr(cls, "_ldet_stateful", False):
        if cls not in _CLASSES:
            skip = {"__dict__", "__weakref__", "__module__", "__qualname__", "__doc__", "__annotations__"}
            methods = {k: v for k, v in vars(StatefulLoaderMixin).items() if k not in skip}
            _CLASSES[cls] = type(
                f"Stateful{cls.__name__}",
                (cls,),
                {**methods, "__module__": __name__, "_ldet_stateful": True, "_ldet_converted": True},
            )
        loader.__class__ = _CLASSES[cls]
        loader._ldet_history = deque(maxlen=HISTORY)  # type: ignore[attr-defined]
        loader._ldet_batches = 0  # type: ignore[attr-defined]
        loader._ldet_epoch_before = int(getattr(loader, "current_epoch", 0))  # type: ignore[attr-defined]
        loader._ldet_loading = False  # type: ignore[attr-defined]
        loader._ldet_origin = None  # type: ignore[attr-defined]
        loader._ldet_epoch_done = False  # type: ignore[attr-defined]
    loader._ldet_trainer = weakref.ref(trainer) if trainer is not None else (lambda: None)  # type: ignore[attr-defined]
    return loader


__all__ = ["StatefulLoaderMixin", "is_stateful_loader", "make_stateful"]
