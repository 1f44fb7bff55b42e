"""A fixed binary tree of gradient sums: the same bits for any split of its leaves over power-of-two process counts.

The leaves are the micro-batch gradients of one optimizer step, in micro-batch order ``0 .. M-1`` (``M`` a power of
two). Their sum is the balanced pairwise tree: ``((g0 + g1) + (g2 + g3)) + ...``. A process holding the contiguous
leaves ``r*K .. r*K + K - 1`` (``K = M / W``, a power of two) computes its subtree as the leaves arrive, then the
processes climb the tree together: at level ``l`` process ``r`` and ``r XOR 2**l`` add their two subtrees with a
two-process ``all_reduce`` -- a single addition per element, and ``a + b == b + a`` bit for bit, so both get the same
parent. After ``log2(W)`` levels every process holds the root: exactly the sum one process computes on its own.

Sums are taken in the gradients' own dtype (float32): the tree's error grows with ``log2(M)``, not with ``M`` as the
sequential accumulation of DDP does (``benchmarks/invariance.py`` measures both against float64). Buffers are
allocated once: ``log2(K) + 1`` flat vectors of the gradient's size.

This module is a leaf: it knows ``torch.distributed``, not Lightning.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor


def tree_sum(tensors: Sequence[Tensor]) -> Tensor:
    """The fixed tree over a power-of-two list, left to right: the reference the distributed sum must equal.

    Examples:
        >>> tree_sum([torch.tensor(1.0), torch.tensor(2.0), torch.tensor(3.0), torch.tensor(4.0)])
        tensor(10.)
    """
    level = list(tensors)
    while len(level) > 1:
        level = [level[i] + level[i + 1] for i in range(0, len(level), 2)]
    return level[0]


def pair_groups(world_size: int) -> list[dict[int, object]]:
    """For each level of the tree above the processes, every process's two-process group (created on every rank).

    ``dist.new_group`` must be called by all processes for every group, in the same order: this does it.
    """
    levels: list[dict[int, object]] = []
    span = 1
    while span < world_size:
        groups: dict[int, object] = {}
        for rank in range(world_size):
            partner = rank ^ span
            if rank < partner:
                group = dist.new_group(ranks=[rank, partner])
                groups[rank] = groups[partner] = group
        levels.append(groups)
        span *= 2
    return levels


class GradientTree:
    """One process's part of the fixed tree over an optimizer step's micro-batch gradients.

    Args:
        parameters: the parameters whose gradients are summed, in a fixed order.
        leaves: ``K``, this process's micro-batches per step (a power of two).
        groups: :func:`pair_groups` of the world (empty for one process).
        rank: this process's rank.

    Examples:
        >>> p = torch.nn.Parameter(torch.zeros(2))
        >>> tree = GradientTree([p], leaves=2, groups=[], rank=0)
        >>> for g in ([1.0, 2.0], [3.0, 4.0]):
        ...     p.grad = torch.tensor(g)
        ...     tree.add_leaf()
        >>> tree.finish(divide_by=1)
        >>> p.grad
        tensor([4., 6.])
    """

    def __init__(self, parameters: Sequence[torch.nn.Parameter], leaves: int, groups: list, rank: int) -> None:
        self.parameters = list(parameters)
        self.leaves, self.groups, self.rank = leaves, groups, rank
        self.numel = sum(p.numel() for p in self.parameters)
        self._buffers: list[Tensor] = []
        self._stack: list[tuple[int, Tensor]] = []
        self._result: Tensor | None = None
        self.added = 0

    def _buffer(self) -> Tensor:
        in_use = {id(buffer) for _, buffer in self._stack}
        for buffer in self._buffers:
            if id(buffer) not in in_use:
                return buffer
        first = self.parameters[0]
        buffer = torch.empty(self.numel, dtype=first.dtype, device=first.device)
        self._buffers.append(buffer)
        return buffer

    def add_leaf(self) -> None:
        """Take the parameters' current gradients as the next leaf (and clear them for the next micro-batch)."""
        leaf = self._buffer()
        offset = 0
        for p in self.parameters:
            n = p.numel()
            if p.grad is None:
                leaf[offset : offset + n].zero_()
            else:
                leaf[offset : offset + n].copy_(p.grad.reshape(-1))
                p.grad = None
            offset += n
        level, value = 0, leaf
        while self._stack and self._stack[-1][0] == level:
            _, left = self._stack.pop()
            value = left.add_(value)  # left + right, in place in the left subtree's buffer
            level += 1
        self._stack.append((level, value))
        self.added += 1

    def finish(self, divide_by: int) -> None:
        """Climb the tree with the other processes, divide the root exactly, and set it as the gradients.

        Raises:
            RuntimeError: if this process took another number of leaves than it owns.
        """
        if self.added != self.leaves or len(self._stack) != 1:
            raise RuntimeError(
                f"the gradient tree took {self.added} micro-batches in this step, expected {self.leaves}"
            )
        _, root = self._stack.pop()
        for groups in self.groups:
            dist.all_reduce(root, group=groups[self.rank])  # two processes: one addition, commutative
        if self._result is None:
            self._result = torch.empty_like(root)
        torch.div(root, divide_by, out=self._result)  # a power of two: exact
        offset = 0
        for p in self.parameters:
            n = p.numel()
            p.grad = self._result[offset : offset + n].view(p.shape)
            offset += n
        self.added = 0


__all__ = ["GradientTree", "pair_groups", "tree_sum"]
