"""Evaluation samplers that count every sample exactly once.

Lightning injects a ``DistributedSampler`` into validation and test loaders; with ``drop_last=False`` it pads the
dataset with repeated samples until its size divides by the world size, so a metric over 7 samples on 2 ranks sees
8. Evaluation does not need equal batch counts per rank (no gradient sync), so the deterministic strategies swap
that sampler for :class:`UnpaddedDistributedSampler`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSamplerWrapper
from lightning.pytorch.utilities.data import _update_dataloader
from torch.utils.data import DataLoader, DistributedSampler


class UnpaddedDistributedSampler(DistributedSampler):
    """A ``DistributedSampler`` that gives rank ``r`` the indices ``r, r + world, r + 2 * world, ...`` and no padding.

    Shuffling, when asked for, uses the same ``seed + epoch`` permutation as ``DistributedSampler``. Ranks may get
    one sample more or less than each other: fine for evaluation, not for training under DDP.

    Example:
        >>> [list(UnpaddedDistributedSampler(range(7), num_replicas=2, rank=r, shuffle=False)) for r in (0, 1)]
        [[0, 2, 4, 6], [1, 3, 5]]
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["drop_last"] = False
        super().__init__(*args, **kwargs)
        total = len(self.dataset)  # type: ignore[arg-type]
        self.total_size = total
        self.num_samples = max(0, math.ceil((total - self.rank) / self.num_replicas))

    def __iter__(self) -> Iterator[int]:
        total = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(total, generator=generator).tolist()
        else:
            indices = list(range(total))
        return iter(indices[self.rank : total : self.num_replicas])


def unpad_eval_dataloader(dataloader: object) -> object:
    """Swap a padding ``DistributedSampler`` in an evaluation loader for one that counts each sample once.

    Anything else (non-``DataLoader`` iterables, other samplers, a single replica) is returned unchanged.

    Example:
        >>> loader = DataLoader(range(7), sampler=DistributedSampler(range(7), num_replicas=2, rank=1, shuffle=False))
        >>> len(loader.sampler), len(unpad_eval_dataloader(loader).sampler)
        (4, 3)
    """
    if not isinstance(dataloader, DataLoader):
        return dataloader
    sampler = dataloader.sampler
    kind = type(sampler)
    if kind not in (DistributedSampler, DistributedSamplerWrapper) or sampler.num_replicas == 1:  # type: ignore[attr-defined]
        return dataloader
    kwargs = {"num_replicas": sampler.num_replicas, "rank": sampler.rank, "shuffle": sampler.shuffle}  # type: ignore[attr-defined]
    if kind is DistributedSampler:
        new: DistributedSampler = UnpaddedDistributedSampler(sampler.dataset, seed=sampler.seed, **kwargs)  # type: ignore[attr-defined]
    else:
        new = UnrepeatedDistributedSamplerWrapper(sampler.dataset._sampler, **kwargs)  # type: ignore[attr-defined]
    return _update_dataloader(dataloader, new)


__all__ = ["UnpaddedDistributedSampler", "unpad_eval_dataloader"]
