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

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

BUCKET_BYTES = 4 * 2**20
"""Gradient bytes per bucket of the overlapped communication (smaller than DDP's 25 MB: more of it can overlap)."""


def _buckets(parameters: Sequence[torch.nn.Parameter], bucket_bytes: int) -> list[list[int]]:
    """Parameter indices in buckets of about ``bucket_bytes``, from the last parameter to the first.

    The backward produces gradients roughly in that order; each bucket is a contiguous range of the flat vector.
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for index in reversed(range(len(parameters))):
        current.insert(0, index)
        size += parameters[index].numel() * parameters[index].element_size()
        if size >= bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


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

    def __init__(
        self,
        parameters: Sequence[torch.nn.Parameter],
        leaves: int,
        groups: list,
        rank: int,
        bucket_bytes: int = BUCKET_BYTES,
    ) -> None:
        self.parameters = list(parameters)
        self.leaves, self.groups, self.rank = leaves, groups, rank
        self.numel = sum(p.numel() for p in self.parameters)
        self._buffers: list[Tensor] = []
        self._stack: list[tuple[int, Tensor]] = []
        self._result: Tensor | None = None
        self.added = 0
        self._offsets = [0]
        for p in self.parameters:
            self._offsets.append(self._offsets[-1] + p.numel())
        self._buckets = _buckets(self.parameters, bucket_bytes)
        self._bucket_of = {i: b for b, members in enumerate(self._buckets) for i in members}
        # The overlapped last leaf (see arm()): its buffer, what each bucket still waits for, the hooks, the handles.
        self._leaf: Tensor | None = None
        self._pending: list[int] = []
        self._roots: list[Tensor | None] = []
        self._hooks: list[Any] = []
        self._handles: list[Any] = []

    def _buffer(self) -> Tensor:
        in_use = {id(buffer) for _, buffer in self._stack}
        for buffer in self._buffers:
            if id(buffer) not in in_use:
                return buffer
        first = self.parameters[0]
        buffer = torch.empty(self.numel, dtype=first.dtype, device=first.device)
        self._buffers.append(buffer)
        return buffer

    def arm(self) -> None:
        """Overlap the coming micro-batch, the step's last, with the first level of communication.

        Each bucket of parameters (contiguous in the flat order, filled in the backward's order) is added into the
        tree and its ``all_reduce`` with the partner process started as soon as the backward has produced all its
        gradients, while the backward goes on with the next ones (as DDP's buckets do). The additions and their order
        are those of :meth:`add_leaf`: the bits do not change. Without other processes there is nothing to overlap.
        """
        if not self.groups or self._hooks or self.added != self.leaves - 1:
            return
        # The last leaf is a right child (K is a power of two): its gradients are added straight into its left
        # sibling, the subtree on top of the stack. Only a single leaf per process (K = 1) needs a buffer of its own.
        self._leaf = None if self._stack and self._stack[-1][0] == 0 else self._buffer()
        self._pending = [len(members) for members in self._buckets]
        self._roots = [None] * len(self._buckets)
        for index, p in enumerate(self.parameters):
            self._hooks.append(p.register_post_accumulate_grad_hook(functools.partial(self._ready, index)))

    def disarm(self) -> None:
        """Remove the hooks of :meth:`arm` (a step that ended another way, a new fit)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _ready(self, index: int, param: torch.nn.Parameter) -> None:
        bucket = self._bucket_of[index]
        self._pending[bucket] -= 1
        if self._pending[bucket] == 0:
            self._flush(bucket)

    def _flush(self, bucket: int) -> None:
        """Add one bucket's gradients as the last leaf's part and start the bucket's first-level ``all_reduce``."""
        self._pending[bucket] = -1  # done
        members = self._buckets[bucket]
        start, end = self._offsets[members[0]], self._offsets[members[-1] + 1]
        if self._leaf is None:  # straight into the left sibling (see arm)
            _add_gradients(self.parameters, members, self._offsets, self._stack[-1][1])
            level, value, below = 1, self._stack[-1][1][start:end], self._stack[:-1]
        else:
            for i in members:
                p, part = self.parameters[i], self._leaf[self._offsets[i] : self._offsets[i + 1]]
                if p.grad is None:
                    part.zero_()
                else:
                    part.copy_(p.grad.reshape(-1))
            level, value, below = 0, self._leaf[start:end], self._stack
        # The last leaf closes every open subtree: the same in-place additions as add_leaf, on this slice only.
        for entry_level, left in reversed(below):
            if entry_level != level:
                break
            value = left[start:end].add_(value)
            level += 1
        self._roots[bucket] = value
        # Collectives start in bucket order on every process (as DDP's do), whatever order the buckets filled in.
        while len(self._handles) < len(self._buckets) and self._roots[len(self._handles)] is not None:
            root = self._roots[len(self._handles)]
            self._handles.append(dist.all_reduce(root, group=self.groups[0][self.rank], async_op=True))

    def add_leaf(self) -> None:
        """Take the parameters' current gradients as the next leaf (and clear them for the next micro-batch)."""
        if self._hooks:
            self._add_overlapped_leaf()
            return
        if self._stack and self._stack[-1][0] == 0:  # a right child: added straight into its left sibling
            _, value = self._stack.pop()
            _add_gradients(self.parameters, range(len(self.parameters)), self._offsets, value)
            for p in self.parameters:
                p.grad = None
            level = 1
        else:
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

    def _add_overlapped_leaf(self) -> None:
        """The armed last leaf: flush the buckets the backward left (unused parameters), then close the stack."""
        self.disarm()
        for bucket, pending in enumerate(self._pending):
            if pending != -1:
                self._flush(bucket)
        for p in self.parameters:
            p.grad = None
        level, root = 0, self._leaf
        while self._stack and self._stack[-1][0] == level:
            _, root = self._stack.pop()
            level += 1
        assert root is not None
        self._stack.append((level, root))
        self._leaf = None
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
        levels = self.groups
        if self._handles:  # the first level ran bucket by bucket during the backward
            for handle in self._handles:
                handle.wait()
            self._handles = []
            levels = self.groups[1:]
        for groups in levels:
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


def _add_gradients(parameters: Sequence[torch.nn.Parameter], members: Any, offsets: list[int], left: Tensor) -> None:
    """``left += grad`` for each parameter of ``members``, on its slice of the flat vector.

    The tree's addition of a right child into its left sibling, without copying the child first (a missing gradient
    adds zeros, as a zeroed copy would: ``-0.0 + 0.0`` is ``+0.0``).
    """
    for i in members:
        part, grad = left[offsets[i] : offsets[i + 1]], parameters[i].grad
        if grad is None:
            part.add_(0.0)
        else:
            part.add_(grad.reshape(-1))


class PairwiseAllReduce:
    """A DDP communication hook whose sums do not depend on where a gradient sits in its bucket.

    A ring all-reduce over more than two processes adds each element's ``W`` terms in an order set by the chunk of the
    flat bucket the element falls in; DDP rebuilds its buckets after the first step of every run (in the order the
    gradients became ready), so the first steps of a resumed run put gradients elsewhere than the uninterrupted run,
    and their sums differ in the last bits. Here every bucket climbs the tree of :func:`pair_groups` instead (a
    power-of-two ``W``; a single addition per element and level): ``(g0 + g1) + (g2 + g3)`` wherever it sits. Other
    process counts gather every process's bucket and add them in rank order. Each bucket is divided by ``W`` first, as
    DDP's default hook does.

    Args:
        world_size: the number of processes (more than two: with two, DDP's own sum is one addition already).
        rank: this process's rank.
    """

    def __init__(self, world_size: int, rank: int) -> None:
        self.world_size, self.rank = world_size, rank
        self.power_of_two = world_size & (world_size - 1) == 0
        self.levels = pair_groups(world_size) if self.power_of_two else []

    def reduce(self, state: object, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
        """Reduce ``bucket`` in place (blocking: each level waits for the one below)."""
        buffer = bucket.buffer()
        buffer.div_(self.world_size)
        if self.power_of_two:
            for groups in self.levels:
                dist.all_reduce(buffer, group=groups[self.rank])  # type: ignore[arg-type]
        else:
            parts = [torch.empty_like(buffer) for _ in range(self.world_size)]
            dist.all_gather(parts, buffer)
            total = parts[0].clone()
            for part in parts[1:]:
                total.add_(part)
            buffer.copy_(total)
        future: torch.futures.Future[Tensor] = torch.futures.Future()
        future.set_result(buffer)
        return future


# DDP checks a hook's annotations as objects; this module's annotations are strings (postponed evaluation).
PairwiseAllReduce.reduce.__annotations__ = {
    "state": object,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}

__all__ = ["GradientTree", "PairwiseAllReduce", "pair_groups", "tree_sum"]
