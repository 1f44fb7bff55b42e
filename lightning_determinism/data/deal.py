"""An interrupted epoch resumed on another number of data-parallel ranks: the rest of its samples, dealt anew.

A ``DistributedSampler``'s epoch is a function of (dataset length, seed, shuffle, drop_last, number of replicas,
epoch): its padded order ``order`` gives replica ``r`` the samples ``order[r::W]``, so after ``c`` batches of ``B``
on every replica the epoch has consumed exactly ``order[:c * B * W]``. A checkpoint keeps that (:func:`deal_entry`);
a run resumed on ``W'`` replicas deals the rest, ``order[c * B * W:]``, padded to a multiple of ``W'`` as the sampler
pads (or cut, under its ``drop_last``), ``W'`` ways (:func:`dealt_share`): every sample of the interrupted epoch is
trained once (the padding's repeats aside, as in any ``DistributedSampler`` epoch), in the uninterrupted run's
order. A checkpoint written inside such a dealt epoch adds its stage (``worlds``/``consumed``), so a later resume,
on any number of replicas, deals what is left of that. The next epoch is the sampler's own again.

What is not bitwise then: the random numbers (each rank reseeds; see ``RNGStateCheckpoint``) and the reductions'
order (another number of ranks), so the parameters differ in their last bits from the uninterrupted run's.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DistributedSampler


def stock_distributed_sampler(loader: Any) -> DistributedSampler[Any] | None:
    """The loader's sampler if it is torch's ``DistributedSampler`` (Lightning's injected one), else ``None``."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    sampler = getattr(batch_sampler, "sampler", None) if batch_sampler is not None else getattr(loader, "sampler", None)
    return sampler if type(sampler) is DistributedSampler else None


def deal_entry(loader: Any, skip: int) -> dict[str, Any] | None:
    """What a checkpoint keeps to deal the rest of the loader's epoch on another world; ``None`` if it cannot."""
    sampler = stock_distributed_sampler(loader)
    batch = getattr(loader, "batch_size", None)
    if sampler is None or batch is None:
        return None
    active = getattr(loader, "_ldet_dealt", None)  # this epoch is itself a dealt rest: add its stage
    worlds, consumed = (list(active["worlds"]), list(active["consumed"])) if active else ([], [])
    return {
        "length": len(sampler.dataset),  # type: ignore[arg-type]
        "seed": int(sampler.seed),
        "shuffle": bool(sampler.shuffle),
        "drop_last": bool(sampler.drop_last),
        "batch": int(batch),
        "worlds": [*worlds, int(sampler.num_replicas)],
        "consumed": [*consumed, int(skip)],
    }


def needs_deal(deal: dict[str, Any], loader: Any) -> bool:
    """Whether the saved position must be dealt anew: another number of replicas, or an epoch dealt before."""
    sampler = stock_distributed_sampler(loader)
    replicas = int(sampler.num_replicas) if sampler is not None else None
    return len(deal["worlds"]) > 1 or deal["worlds"][0] != replicas


def _pad(order: list[int], world: int, drop_last: bool) -> list[int]:
    """``order`` made a multiple of ``world`` long as ``DistributedSampler`` does: cut, or padded with its head."""
    if drop_last:
        return order[: len(order) // world * world]
    missing = -len(order) % world
    while missing:
        take = order[:missing]
        order, missing = order + take, missing - len(take)
    return order


def epoch_order(deal: dict[str, Any], epoch: int) -> list[int]:
    """The padded order of the first stage's ``DistributedSampler`` in ``epoch``: replica ``r`` got ``[r::W]``."""
    world = deal["worlds"][0]
    shares = []
    for rank in range(world):
        indices: Any = range(deal["length"])  # any sized sequence serves as the dataset
        sampler: DistributedSampler[int] = DistributedSampler(
            indices, num_replicas=world, rank=rank, shuffle=deal["shuffle"], seed=deal["seed"],
            drop_last=deal["drop_last"],
        )  # fmt: skip
        sampler.set_epoch(epoch)
        shares.append(list(sampler))
    return [index for column in zip(*shares, strict=True) for index in column]


def rest_of_epoch(deal: dict[str, Any], epoch: int) -> list[int]:
    """The samples of the interrupted epoch no replica consumed yet, in the uninterrupted run's order."""
    order = epoch_order(deal, epoch)
    for stage, (world, consumed) in enumerate(zip(deal["worlds"], deal["consumed"], strict=True)):
        if stage:
            order = _pad(order, world, deal["drop_last"])
        order = order[consumed * deal["batch"] * world :]
    return order


def dealt_share(deal: dict[str, Any], epoch: int, rank: int, world: int) -> list[int]:
    """Replica ``rank`` of ``world``'s share of the rest of the interrupted epoch."""
    return _pad(rest_of_epoch(deal, epoch), world, deal["drop_last"])[rank::world]


def check_same_sampler(deal: dict[str, Any], loader: Any) -> None:
    """Refuse to deal a saved position into a sampler that orders the epoch otherwise (another seed, shuffle, data).

    Raises:
        RuntimeError: naming what changed.
    """
    sampler = stock_distributed_sampler(loader)
    if sampler is None:
        raise RuntimeError(
            "The checkpoint was written mid-epoch under a DistributedSampler and is resumed on another number of"
            f" data-parallel ranks with a training loader sampled by {type(getattr(loader, 'sampler', None)).__name__}:"
            " the rest of the epoch cannot be dealt. Resume with the sampler it was written with."
        )
    now = {"length": len(sampler.dataset), "seed": int(sampler.seed), "shuffle": bool(sampler.shuffle),  # type: ignore[arg-type]
           "drop_last": bool(sampler.drop_last), "batch": getattr(loader, "batch_size", None)}  # fmt: skip
    changed = [f"{key} {deal[key]} -> {value}" for key, value in now.items() if deal[key] != value]
    if changed:
        raise RuntimeError(
            f"The checkpoint was written mid-epoch by a training loader whose {', '.join(changed)} since: the rest of"
            " the interrupted epoch would be other samples. Resume with the data, seed and batch size it was written"
            " with, or from a checkpoint written at an epoch boundary."
        )


__all__ = [
    "check_same_sampler",
    "deal_entry",
    "dealt_share",
    "epoch_order",
    "needs_deal",
    "rest_of_epoch",
    "stock_distributed_sampler",
]
