"""Skipping the batches a resumed epoch already consumed, at the index level, before any sample is read.

Used by :mod:`~lightning_determinism.data.resumable`: a resumed iterator's index sampler is wrapped in
:class:`SkipOnce`, which drops the consumed indices at its first draw; list and range iterators (and generators
delegating to one, as ``RandomSampler``'s) jump in O(1).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterator
from typing import Any

from torch.utils.data import BatchSampler

from lightning_determinism._compat.data import sampler_iter, set_sampler_iter

END = object()
SEEKABLE: tuple[type, ...] = (type(iter([])), type(iter(range(0))))


def seek(iterator: Any, n: int) -> int:
    """Advance a list or range iterator by up to ``n`` items in O(1); returns how many it advanced."""
    left = operator.length_hint(iterator)
    step = min(n, left)
    iterator.__setstate__(iterator.__reduce__()[2] + step)
    return step


def consume(iterator: Any, n: int) -> None:
    """Advance ``iterator`` by ``n`` items without looking at them.

    List and range iterators (``DistributedSampler``, ``SequentialSampler``) and generators that delegate to one
    (``RandomSampler``'s ``yield from randperm(n).tolist()``) jump in O(1); anything else is advanced at C speed
    (itertools' consume recipe). Skipping 90 % of an epoch then costs what skipping nothing does.
    """
    while n > 0:
        if isinstance(iterator, SEEKABLE):
            seek(iterator, n)
            return
        inner: Any = getattr(iterator, "gi_yieldfrom", None)
        if isinstance(inner, SEEKABLE) and operator.length_hint(inner) > 0:
            n -= seek(inner, n)
            continue
        if next(iterator, END) is END:  # start the generator, or move it to its next delegate
            return
        n -= 1


class SkippedSampler:
    """``sampler`` without its first ``skip`` indices (the fast path under a ``BatchSampler``)."""

    def __init__(self, sampler: Any, skip: int) -> None:
        self.sampler, self.skip = sampler, skip

    def __iter__(self) -> Iterator[Any]:
        iterator = iter(self.sampler)
        consume(iterator, self.skip)
        return iterator

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self.skip)


class SkipOnce:
    """An index sampler whose first iteration starts ``skip`` items (batches) in.

    The skip happens at the first item drawn, like the sampler's own random draw (``RandomSampler`` seeds itself at
    its first item): after the ``DataLoader`` iterator drew its worker seed, as in the uninterrupted run. Later
    iterations (persistent workers' next epochs) are the inner sampler's own.
    """

    def __init__(self, inner: Any, skip: int) -> None:
        self.inner, self.skip = inner, skip
        self._pending = True

    def __iter__(self) -> Iterator[Any]:
        # A generator: the iterator that is first *drawn from* skips (DataLoader iterators may call iter() twice).
        if not self._pending:
            yield from self.inner
            return
        yield from self._skipped()

    def _skipped(self) -> Iterator[Any]:
        if not self._pending:  # another iterator of this sampler drew first
            yield from self.inner
            return
        self._pending = False
        skip = self.skip
        if skip and type(self.inner) is BatchSampler:  # skip indices, not batches: itertools, not python loops
            yield from BatchSampler(
                SkippedSampler(self.inner.sampler, skip * self.inner.batch_size),
                self.inner.batch_size,
                self.inner.drop_last,
            )
            return
        iterator = iter(self.inner)
        consume(iterator, skip)
        yield from iterator

    def __len__(self) -> int:
        return len(self.inner)


class DealtOnce(SkipOnce):
    """An index sampler whose first iteration serves ``order`` (a dealt rest of an epoch: ``data.deal``) instead.

    Under a ``BatchSampler`` the indices are batched as the loader batches; later iterations are the inner
    sampler's own.
    """

    def __init__(self, inner: Any, order: list[int]) -> None:
        super().__init__(inner, 0)
        self.order = order

    def _skipped(self) -> Iterator[Any]:
        if not self._pending:
            yield from self.inner
            return
        self._pending = False
        if isinstance(self.inner, BatchSampler):
            yield from BatchSampler(self.order, self.inner.batch_size, self.inner.drop_last)  # type: ignore[arg-type]
            return
        yield from self.order

    def __len__(self) -> int:
        if self._pending and isinstance(self.inner, BatchSampler):
            return len(BatchSampler(self.order, self.inner.batch_size, self.inner.drop_last))  # type: ignore[arg-type]
        return len(self.order) if self._pending else len(self.inner)


def prime(iterator: Any) -> None:
    """Draw the first index of a single-process iterator now (the sampler's random draw happens with it)."""
    indices = sampler_iter(iterator)
    if indices is None:
        return  # worker iterators drew their first indices when they were created
    first = next(indices, END)
    set_sampler_iter(iterator, indices if first is END else itertools.chain([first], indices))


__all__ = ["END", "DealtOnce", "SkipOnce", "SkippedSampler", "consume", "prime", "seek"]
