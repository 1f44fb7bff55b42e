"""An interrupted epoch resumed on another number of data-parallel ranks: the rest of its samples, dealt anew.

A ``DistributedSampler``'s epoch is a function of (dataset length, seed, shuffle, drop_last, number of replicas,
epoch): its padded order ``order`` gives replica ``r`` the samples ``order[r::W]``, so after ``c`` batches of ``B``
on every replica the epoch has consumed exactly ``order[:c * B * W]``. A checkpoint keeps that (:func:`deal_entry`);
a run resumed on ``W'`` replicas deals the rest, ``order[c * B * W:]``, padded to a multiple of ``W'`` as the sampler
pads (or cut, under its ``drop_last``), ``W'`` ways (:func:`dealt_share`): every sample of the interrupted epoch is
trained once (the padding's repeats aside, as in any ``DistributedSampler`` epoch), in the uninterrupted run's
order. A checkpoint written inside such a dealt epoch adds its stage (``worlds``/``consumed``), so a later resume,
on any number of replicas, deals what is left of that. The next epoch is the sampler's own again.

Resumed on one process, Lightning injects no ``DistributedSampler``: the loader samples with its own sampler
(``RandomSampler``, ``SequentialSampler``, a user's). The one process then takes the whole rest, in the same order,
and the epochs after follow its own sampler (:func:`check_dealable` says so in one warning). What cannot be dealt
(another dataset length or batch size, several ranks without a ``DistributedSampler``, a user's batch sampler) is
refused when the loader's iterator is made, before its first batch.

What is not bitwise then: the random numbers (each rank reseeds; see ``RNGStateCheckpoint``) and the reductions'
order (another number of ranks), so the parameters differ in their last bits from the uninterrupted run's.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DistributedSampler, IterableDataset


def stock_distributed_sampler(loader: Any) -> DistributedSampler[Any] | None:
    """The loader's sampler if it is torch's ``DistributedSampler`` (Lightning's injected one), else ``None``."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    sampler = getattr(batch_sampler, "sampler", None) if batch_sampler is not None else getattr(loader, "sampler", None)
    return sampler if type(sampler) is DistributedSampler else None


def deal_entry(loader: Any, skip: int) -> dict[str, Any] | None:
    """What a checkpoint keeps to deal the rest of the loader's epoch on another world; ``None`` if it cannot."""
    sampler = stock_distributed_sampler(loader)
    batch = getattr(loader, "batch_size", None)
    active = getattr(loader, "_ldet_dealt", None)  # this epoch is itself a dealt rest: add its stage
    if batch is None or (sampler is None and not active):
        return None
    if active:  # dealt into a DistributedSampler, or into one process's own sampler (one replica)
        replicas = int(sampler.num_replicas) if sampler is not None else 1
        return {**active, "worlds": [*active["worlds"], replicas], "consumed": [*active["consumed"], int(skip)]}
    assert sampler is not None
    return {
        "length": len(sampler.dataset),  # type: ignore[arg-type]
        "seed": int(sampler.seed),
        "shuffle": bool(sampler.shuffle),
        "drop_last": bool(sampler.drop_last),
        "batch": int(batch),
        "worlds": [int(sampler.num_replicas)],
        "consumed": [int(skip)],
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


def _sampler_name(loader: Any) -> str:
    batch_sampler = getattr(loader, "batch_sampler", None)
    sampler = getattr(batch_sampler, "sampler", None) if batch_sampler is not None else getattr(loader, "sampler", None)
    return type(sampler).__name__


def check_dealable(deal: dict[str, Any], loader: Any, epoch: int, one_process: bool) -> str | None:
    """Refuse a saved position that cannot be dealt into ``loader``; the warning to give where it is dealt otherwise.

    Dealt into a ``DistributedSampler``, it must order the epoch as the saved one did (:func:`check_same_sampler`).
    Without one, only ``one_process`` can take the rest (all of it): the dataset's length and the batch size must be
    the saved ones (a saved count of batches is a count of samples); the message returned says that the epochs
    after follow the loader's own sampler.

    Raises:
        RuntimeError: naming what cannot be dealt, in one line.

    Examples:
        >>> from torch.utils.data import DataLoader
        >>> deal = {"length": 8, "seed": 0, "shuffle": True, "drop_last": False, "batch": 2, "worlds": [2],
        ...         "consumed": [1]}
        >>> message = check_dealable(deal, DataLoader(range(8), batch_size=2, shuffle=True), 0, one_process=True)
        >>> message[message.index("RandomSampler"):][:87]
        'RandomSampler: the 4 samples of the interrupted epoch not trained yet are dealt to this'
    """
    if stock_distributed_sampler(loader) is not None:
        check_same_sampler(deal, loader)
        return None
    name, batch, world = _sampler_name(loader), getattr(loader, "batch_size", None), deal["worlds"][0]
    streamed = isinstance(getattr(loader, "dataset", None), IterableDataset)
    if not one_process or batch is None or streamed:
        how = (
            "on several ranks without a DistributedSampler"
            if not one_process
            else "with a batch sampler of its own"
            if batch is None
            else "over an IterableDataset"
        )
        raise RuntimeError(
            f"The checkpoint was written in the middle of an epoch under a DistributedSampler over {world} ranks and is"
            f" resumed with a training loader sampled by {name} {how}: the rest of the epoch cannot be dealt (only a"
            " DistributedSampler's replicas, or one process, can take it). Resume with Lightning's DistributedSampler"
            " (use_distributed_sampler=True) or on one process, or from a checkpoint written at an epoch boundary."
        )
    now = (("length", _length(loader)), ("batch", batch))
    changed = [f"{key} {deal[key]} -> {value}" for key, value in now if deal[key] != value]
    if changed:
        raise _changed(changed)
    return (
        f"The checkpoint was written in the middle of epoch {epoch} under a DistributedSampler over {world} ranks and"
        f" is resumed on one process whose training loader samples with {name}: the {len(rest_of_epoch(deal, epoch))}"
        " samples of the interrupted epoch not trained yet are dealt to this process, each once, in the uninterrupted"
        f" run's order, and the epochs after follow {name}'s own order (lightning_determinism.data.deal)."
    )


def _length(loader: Any) -> int | None:
    try:
        return len(loader.dataset)
    except TypeError:
        return None


def _changed(changed: list[str]) -> RuntimeError:
    return RuntimeError(
        f"The checkpoint was written mid-epoch by a training loader whose {', '.join(changed)} since: the rest of"
        " the interrupted epoch would be other samples. Resume with the data, seed and batch size it was written"
        " with, or from a checkpoint written at an epoch boundary."
    )


def share_of(deal: dict[str, Any], loader: Any, epoch: int) -> list[int]:
    """``loader``'s share of the rest of the interrupted ``epoch``: its replica's, or all of it on one process."""
    sampler = stock_distributed_sampler(loader)
    if sampler is None:
        return dealt_share(deal, epoch, 0, 1)
    return dealt_share(deal, epoch, int(sampler.rank), int(sampler.num_replicas))


def check_same_sampler(deal: dict[str, Any], loader: Any) -> None:
    """Refuse to deal a saved position into a sampler that orders the epoch otherwise (another seed, shuffle, data).

    Raises:
        RuntimeError: naming what changed.
    """
    sampler = stock_distributed_sampler(loader)
    assert sampler is not None
    now = {"length": len(sampler.dataset), "seed": int(sampler.seed), "shuffle": bool(sampler.shuffle),  # type: ignore[arg-type]
           "drop_last": bool(sampler.drop_last), "batch": getattr(loader, "batch_size", None)}  # fmt: skip
    changed = [f"{key} {deal[key]} -> {value}" for key, value in now.items() if deal[key] != value]
    if changed:
        raise _changed(changed)


__all__ = [
    "check_dealable",
    "check_same_sampler",
    "deal_entry",
    "dealt_share",
    "epoch_order",
    "needs_deal",
    "rest_of_epoch",
    "share_of",
    "stock_distributed_sampler",
]
