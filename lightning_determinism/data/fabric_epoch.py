"""A map-style loader's place in its epoch under Fabric: counted as the loop draws, resumed at the next batch.

Under the Trainer, Lightning's loop counters say how far into an epoch a checkpoint was written
(:mod:`~lightning_determinism.data.positions`). A Fabric loop has no such counters, so the deterministic Fabric
strategies make every map-style ``DataLoader`` resumable (:mod:`~lightning_determinism.data.resumable`) and its
iterator (:class:`FabricEpochIterator`) counts the batches the loop draws. ``FabricRNGState`` saves that count with the
epoch's RNG states (:func:`fabric_position`); after ``fabric.load`` the loader's next iteration drops the consumed
batches' indices before any sample is read and serves the rest of the interrupted epoch, bitwise (data-loader workers
replay their streams as under the Trainer).

A loop that skips the consumed batches itself, by counting (LitGPT's fast-forward: draw ``n`` batches, drop them, then
train), would then drop ``n`` batches of the rest too. The iterator tells the two loops apart by ``fabric.backward``
(counted by the strategy, :func:`backward_count`) in an epoch that was being trained when it was saved:

- a loop that trains on its first draw runs a backward before its second: the rest of the epoch, in order;
- a loop that draws the ``n`` consumed batches without a backward has its next draw served from batch ``n`` again
  (the batches it dropped were read, then put back: this process's RNG streams are restored as they were before
  them; a rest shorter than ``n`` repeats its last batch until then): the uninterrupted run's batches, bitwise;
- any other count of batches dropped before the first backward (more than one, not ``n``) is warned: it trains other
  batches than the uninterrupted run. One batch drawn ahead (a prefetching loop) is not a skip.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_determinism.data.positions import PLAN_ATTR, loader_shape
from lightning_determinism.errors import DeterminismWarning

_NONE = object()


def backward_count(loader: Any) -> int | None:
    """The ``fabric.backward`` calls of the strategy that set ``loader`` up so far (``None``: not a Fabric loader)."""
    count = getattr(loader, "_ldet_backwards", None)
    return None if count is None else int(count())


def fabric_position(loader: Any, epoch: int) -> dict[str, Any] | None:
    """Where a converted map-style loader stands inside ``epoch`` (``None``: between epochs, or not such a loader).

    Examples:
        >>> from torch.utils.data import DataLoader
        >>> fabric_position(DataLoader(range(4)), 0) is None
        True
    """
    drawn = int(getattr(loader, "_ldet_drawn", 0))
    if not getattr(loader, "_ldet_resumable", False) or getattr(loader, "_ldet_stream", False):
        return None
    pending = getattr(loader, PLAN_ATTR, None)
    if pending is not None and "skip" in pending:  # loaded and not iterated since: saved again as it was loaded
        return dict(pending)
    if drawn == 0 or getattr(loader, "_ldet_epoch_done", True):
        return None
    now = backward_count(loader)
    trained = bool(getattr(loader, "_ldet_trained", False)) or (now is not None and now != loader._ldet_backwards_at)
    return {"epoch": int(epoch), "skip": drawn, "epoch_start": loader._ldet_epoch_start, "shape": loader_shape(loader),
            "trained": int(trained)}  # fmt: skip


class FabricEpochIterator:
    """The iterator a converted map-style loader returns under Fabric: counts the batches the loop draws.

    Args:
        loader: the converted ``DataLoader``.
        create: makes the loader's (lazy) iterator; it takes a pending resume position at its first batch.
    """

    def __init__(self, loader: Any, create: Callable[[], Iterator[Any]]) -> None:
        self.loader, self.create = loader, create
        self.inner: Iterator[Any] | None = None
        self.resumed: dict[str, Any] | None = None  # a trained epoch's position, while the first draws are watched
        self.drawn = 0
        self.first: int | None = None  # backward count at the first draw
        self.before: dict[str, Any] = {}  # this process's streams before the first draw
        self.last: Any = _NONE  # the last batch drawn while watched (repeated if the rest ends before the skip)
        self.rewound = False

    def __iter__(self) -> FabricEpochIterator:
        return self

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[no-any-return]

    def __next__(self) -> Any:
        if self.inner is None:
            self._start()
        self.drawn += 1
        if self.resumed is not None and self.drawn > 1:
            self._watch(self.resumed)
        assert self.inner is not None
        try:
            batch = next(self.inner)
        except StopIteration:
            if self.resumed is not None and not self.rewound and self.last is not _NONE:
                return self.last  # dropped by a loop skipping the consumed batches (see the module notes)
            self.loader._ldet_epoch_done = True
            raise
        self.loader._ldet_drawn += 1
        if self.resumed is not None:
            self.last = batch
        return batch

    def _start(self) -> None:
        loader = self.loader
        plan = getattr(loader, PLAN_ATTR, None)  # peeked: the loader takes it when its iterator is created
        skip = int(plan.get("skip", 0)) if plan else 0
        loader._ldet_drawn, loader._ldet_epoch_done = skip, False
        loader._ldet_trained = bool(plan.get("trained", 0)) if plan else False
        loader._ldet_backwards_at = backward_count(loader)
        if skip and loader._ldet_trained and loader._ldet_backwards_at is not None:
            self.resumed, self.first = plan, loader._ldet_backwards_at
            self.before = loader._ldet_snapshot(True)
        self.inner = self.create()

    def _watch(self, plan: dict[str, Any]) -> None:
        """Draw ``self.drawn`` of a resumed trained epoch: a skip by counting is served, or said (module notes)."""
        skip, name = int(plan["skip"]), type(getattr(self.loader, "dataset", self.loader)).__name__
        if backward_count(self.loader) != self.first:  # the loop trains: nothing more to watch
            self.resumed, self.last = None, _NONE
            dropped = self.drawn - 2  # draws before the first backward, besides the batch it trained on
            if not self.rewound and 2 <= dropped < skip:
                _warn_skip(name, dropped, skip, int(plan["epoch"]))
            return
        if self.drawn == skip + 1 and not self.rewound:
            self._rewind(plan, name)
        elif self.rewound:  # still no backward: more batches skipped than the checkpoint consumed
            self.resumed, self.last = None, _NONE
            _warn_skip(name, self.drawn - 1, skip, int(plan["epoch"]))

    def _rewind(self, plan: dict[str, Any], name: str) -> None:
        """The loop dropped the ``skip`` consumed batches: serve the interrupted epoch from batch ``skip`` again."""
        loader = self.loader
        self.inner = None  # its workers shut down
        loader._ldet_restore(self.before)  # what reading the dropped batches drew in this process
        setattr(loader, PLAN_ATTR, plan)
        self.inner = self.create()
        loader._ldet_drawn = int(plan["skip"])
        self.rewound, self.last = True, _NONE
        rank_zero_info(
            f"The loop dropped {plan['skip']} batches of `{name}` after `fabric.load` (a skip by counting), which"
            f" FabricRNGState had resumed past already: the next batch is batch {plan['skip']} of epoch"
            f" {plan['epoch']} again, as in the uninterrupted run."
        )


def _warn_skip(name: str, dropped: int, skip: int, epoch: int) -> None:
    rank_zero_warn(
        f"After `fabric.load` the loop dropped {dropped} batches of `{name}` before its first `fabric.backward`, but"
        f" the checkpoint was written {skip} batches into epoch {epoch}: this run trains other batches than the"
        f" uninterrupted one. FabricRNGState resumes the loader at batch {skip} (its next iteration serves the rest"
        f" of that epoch): iterate it without skipping, or skip exactly {skip}.",
        category=DeterminismWarning,
    )


__all__ = ["FabricEpochIterator", "backward_count", "fabric_position"]
