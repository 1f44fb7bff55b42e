"""InvariantSampler: one global sample order per epoch, cut into steps and micro-batches, dealt to the ranks.

Part of world-size-invariant training (:mod:`~lightning_determinism.invariance.invariant`): which samples a
micro-batch holds depends on the base seed, the epoch and the micro-batch's index in its step, never on the world
size.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

from lightning_determinism.seeding.seeds import derive_seed


class InvariantSampler(Sampler[int]):
    """One global order cut into micro-batches; rank ``r`` gets its ``K`` micro-batches of every step.

    The order is ``randperm(N)`` from a generator seeded with ``derive_seed(seed, "invariant-order", epoch)`` (or
    ``0 .. N-1`` without shuffling): it depends on the seed and the epoch, never on the rank or the world size.

    Examples:
        >>> [list(InvariantSampler(8, 4, 2, world_size=2, rank=r, seed=0, shuffle=False)) for r in (0, 1)]
        [[0, 1, 4, 5], [2, 3, 6, 7]]
        >>> [list(InvariantSampler(8, 8, 2, world_size=2, rank=r, seed=0, shuffle=False, strided=True)) for r in (0, 1)]
        [[0, 1, 4, 5], [2, 3, 6, 7]]
        >>> list(InvariantSampler(8, 8, 2, world_size=2, rank=0, seed=0, shuffle=False))  # contiguous: 0 and 1
        [0, 1, 2, 3]
    """

    def __init__(
        self, length: int, global_batch_size: int, micro_batch_size: int, world_size: int, rank: int, seed: int,
        shuffle: bool = True, strided: bool = False,
    ) -> None:  # fmt: skip
        if length % global_batch_size:
            raise ValueError(
                f"world-size-invariant training needs a dataset length that `global_batch_size` divides, got"
                f" {length} samples for B={global_batch_size} ({length % global_batch_size} left over): drop them"
                f" (e.g. torch.utils.data.Subset) or choose a B that divides {length}"
            )
        self.length, self.batch, self.micro = length, global_batch_size, micro_batch_size
        self.world_size, self.rank, self.seed, self.shuffle = world_size, rank, seed, shuffle
        self.per_rank = global_batch_size // world_size  # samples of one step on one rank
        self.strided = strided  # micro-batches j*W + r (FSDP2) instead of r*K .. r*K + K - 1
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose order to produce (Lightning calls it)."""
        self.epoch = epoch

    def order(self) -> list[int]:
        """The epoch's global order of sample indices."""
        if not self.shuffle:
            return list(range(self.length))
        generator = torch.Generator()
        generator.manual_seed(derive_seed(self.seed, "invariant-order", self.epoch))
        return torch.randperm(self.length, generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        order = self.order()
        mine: list[int] = []
        passes = self.per_rank // self.micro  # K
        for start in range(0, self.length, self.batch):  # one optimizer step: B samples
            if not self.strided:
                first = start + self.rank * self.per_rank
                mine.extend(order[first : first + self.per_rank])
                continue
            for j in range(passes):
                first = start + (j * self.world_size + self.rank) * self.micro
                mine.extend(order[first : first + self.micro])
        return iter(mine)

    def __len__(self) -> int:
        return self.length // self.world_size


__all__ = ["InvariantSampler"]
