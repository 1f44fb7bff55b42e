"""What a training loader refuses or warns about when it resumes mid-epoch, before or at its first batch.

Used by :mod:`~lightning_determinism.data.resumable`: a saved position that other data or batches would misplace is
refused (:func:`check_shape`), a rest of an epoch dealt over another number of replicas is refused or announced once
(:func:`check_deal`), and persistent workers whose randomness cannot be restored or replayed are warned about
(:func:`warn_if_not_bitwise`).
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_determinism._process import distributed
from lightning_determinism.data import deal as deals
from lightning_determinism.data.positions import shape_change
from lightning_determinism.errors import DeterminismWarning


def check_deal(loader: Any, resume: dict[str, Any] | None) -> None:
    """Refuse a rest of an epoch that cannot be dealt here, or say how it is dealt; once, before its first batch."""
    deal = resume.get("deal") if resume is not None else None
    if deal is None or loader._ldet_deal_checked is deal or not deals.needs_deal(deal, loader):
        return
    message = deals.check_dealable(deal, loader, int(resume["epoch"]), one_process=not distributed())  # type: ignore[index]
    loader._ldet_deal_checked = deal
    if message is not None:
        rank_zero_warn(message, category=DeterminismWarning)


def check_shape(saved: dict[str, Any], loader: Any, skip: int, epoch: int) -> None:
    """Refuse a mid-epoch position that other data or batches would misplace; warn when only the bits differ."""
    moved, bits = shape_change(saved, loader)
    if moved:
        raise RuntimeError(
            f"The checkpoint was written {skip} batches into epoch {epoch} of a training loader whose"
            f" {', '.join(moved)} since: the saved position, a count of batches, would land on other samples and part"
            " of the epoch would be trained twice or not at all. Resume from a checkpoint written at an epoch"
            " boundary, or with the data and batch size it was written with."
        )
    if bits:
        rank_zero_warn(
            f"The checkpoint was written mid-epoch with {', '.join(bits)}: the interrupted epoch continues at its next"
            " sample, but randomness drawn in the data-loader workers (augmentations) follows each worker's own"
            " stream, so the rest of the epoch draws other numbers than the uninterrupted run. With"
            " WorkerSeedCallback(per_sample=True) a sample's randomness does not depend on num_workers.",
            category=DeterminismWarning,
        )


def warn_if_not_bitwise(loader: Any) -> None:
    """Warn that persistent workers carry their randomness over from the epochs before (no restore, no replay)."""
    rank_zero_warn(
        "Resuming mid-epoch with persistent data-loader workers: the randomness they draw (augmentations) carries"
        " over from the epochs before and cannot be restored or replayed (past the first epoch, or with the next"
        " worker's role shifted into the epochs after), so the run may differ from the uninterrupted one. Use"
        " WorkerSeedCallback(per_sample=True) to make every sample's randomness depend on (seed, epoch, index) only.",
        category=DeterminismWarning,
    )


__all__ = ["check_deal", "check_shape", "warn_if_not_bitwise"]
