"""A fixed binary tree of gradient sums: the same bits for any split of its leaves over power-of-two process counts.

The leaves are the micro-batch gradients of one optimizer step, in micro-batch order ``0 .. M-1`` (``M`` a power of
two). Their sum is the balanced pairwise tree: ``((g0 + g1) + (g2 + g3)) + ...``. A process holding the contiguous
leaves ``r*K .. r*K + K - 1`` (``K = M / W``, a power of two) computes its subtree as the leaves arrive, then the
processes climb the tree together: at level ``l`` process ``r`` and ``r XOR 2**l`` add their two subtrees with a
two-process ``all_reduce`` -- a single addition per element, and ``a + b == b + a`` bit for bit, so both get the same
parent. After ``log2(W)`` levels every process holds the root: exactly the sum one process computes on its own.

Sums are taken in the gradients' own dtype (float32): the tree's error grows with ``log2(M)``, not with ``M`` as the
sequential accumulation of DDP does (``benchmarks/invariance.py`` measures both against float64). The sums live in
the gradient tensors autograd allocated (at most ``log2(K) + 1`` sets at once); only buckets of several small
parameters are copied into a flat vector for their communication.

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

    The tree is kept per parameter, in the gradient tensors autograd allocated: a leaf takes each parameter's
    ``.grad`` (and clears it, so that the next backward allocates a new one), and a right child is added in place
    into its left sibling. Nothing is copied, except the buckets of several small parameters, which are gathered
    into one flat vector for their ``all_reduce``.

    Args:
        parameters: the parameters whose gradients are summed, in a fixed order.
        leaves: ``K``, this process's micro-batches per step (a power of two).
        groups: :func:`pair_groups` of the world (empty for one process).
        rank: this process's rank.
        bucket_bytes: gradient bytes per bucket of communication.

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
        self.positive_zeros = False  # set under FSDP2: its sum of a step's gradients has no -0.0 (invariance.fsdp)
        self._stack: list[tuple[int, list[Tensor]]] = []
        self.added = 0
        self._buckets = _buckets(self.parameters, bucket_bytes)
        self._bucket_of = {i: b for b, members in enumerate(self._buckets) for i in members}
        self._staging: dict[int, Tensor] = {}  # flat vectors of the buckets of several parameters
        # The overlapped last leaf (see arm()): what each bucket still waits for, the sums it closed per parameter,
        # the tensor each bucket reduces, the hooks, the started all_reduce handles.
        self._pending: list[int] = []
        self._final: list[Tensor] = []
        self._roots: list[Tensor | None] = []
        self._hooks: list[Any] = []
        self._handles: list[Any] = []

    def _take(self, index: int) -> Tensor:
        """Parameter ``index``'s gradient, from now on the tree's; a parameter without one contributes zeros."""
        p = self.parameters[index]
        grad = p.grad
        p.grad = None
        return torch.zeros_like(p) if grad is None else grad

    def arm(self) -> None:
        """Overlap the coming micro-batch, the step's last, with the first level of communication.

        Each bucket of parameters (filled in the backward's order) is added into the tree and its ``all_reduce``
        with the partner process started as soon as the backward has produced all its gradients, while the backward
        goes on with the next ones (as DDP's buckets do). The additions and their order are those of
        :meth:`add_leaf`: the bits do not change. Without other processes there is nothing to overlap.
        """
        if not self.groups or self._hooks or self.added != self.leaves - 1:
            return
        self._pending = [len(members) for members in self._buckets]
        self._final = [torch.empty(0)] * len(self.parameters)
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
        """Add one bucket's gradients as the last leaf and start the bucket's first-level ``all_reduce``."""
        self._pending[bucket] = -1  # done
        for i in self._buckets[bucket]:
            # The last leaf closes every open subtree: the same in-place additions as add_leaf, on this parameter.
            value, level = self._take(i), 0
            for entry_level, left in reversed(self._stack):
                if entry_level != level:
                    break
                value = left[i].add_(value)  # left + right, in place in the left subtree's tensor
                level += 1
            self._final[i] = value
        self._roots[bucket] = self._gather(bucket, self._final)
        # Collectives start in bucket order on every process (as DDP's do), whatever order the buckets filled in.
        while len(self._handles) < len(self._buckets) and self._roots[len(self._handles)] is not None:
            root = self._roots[len(self._handles)]
            self._handles.append(dist.all_reduce(root, group=self.groups[0][self.rank], async_op=True))

    def _gather(self, bucket: int, sums: Sequence[Tensor]) -> Tensor:
        """What carries ``bucket`` through its ``all_reduce``: a lone parameter's own sum, else a flat copy."""
        members = self._buckets[bucket]
        if len(members) == 1 and sums[members[0]].is_contiguous():
            return sums[members[0]]
        flat = self._staging.get(bucket)
        if flat is None:
            first = self.parameters[members[0]]
            numel = sum(self.parameters[i].numel() for i in members)
            flat = self._staging[bucket] = torch.empty(numel, dtype=first.dtype, device=first.device)
        offset = 0
        for i in members:
            n = self.parameters[i].numel()
            flat[offset : offset + n].view(self.parameters[i].shape).copy_(sums[i])
            offset += n
        return flat

    def _scatter(self, bucket: int, reduced: Tensor | None, sums: Sequence[Tensor], divide_by: int) -> None:
        """Divide a bucket's reduced sums exactly and set them as the gradients, each in its parameter's tensor.

        ``reduced`` is what :meth:`_gather` gave (``None`` without other processes: the sums are in place).
        """
        flat = reduced if reduced is not None and reduced is self._staging.get(bucket) else None
        offset = 0
        for i in self._buckets[bucket]:
            p, total = self.parameters[i], sums[i]
            if flat is not None:  # a flat copy: back into the parameter's own tensor
                part = flat[offset : offset + p.numel()].view(p.shape)
                offset += p.numel()
                if divide_by == 1:
                    total.copy_(part)
                else:
                    torch.div(part, divide_by, out=total)  # a power of two: exact
            elif divide_by != 1:
                total.div_(divide_by)
            if self.positive_zeros:
                total.add_(0.0)  # -0.0 -> 0.0, as FSDP2's sharded gradients 0 + ... + g are (invariance.fsdp)
            p.grad = total

    def add_leaf(self) -> None:
        """Take the parameters' current gradients as the next leaf (and clear them for the next micro-batch)."""
        if self._hooks:
            self._add_overlapped_leaf()
            return
        value, level = [self._take(i) for i in range(len(self.parameters))], 0
        while self._stack and self._stack[-1][0] == level:
            _, left = self._stack.pop()
            for a, b in zip(left, value, strict=True):
                a.add_(b)  # left + right, in place in the left subtree's tensors
            value, level = left, level + 1
        self._stack.append((level, value))
        self.added += 1

    def _add_overlapped_leaf(self) -> None:
        """The armed last leaf: flush the buckets the backward left (unused parameters), then close the stack."""
        self.disarm()
        for bucket, pending in enumerate(self._pending):
            if pending != -1:
                self._flush(bucket)
        level = self._stack[0][0] + 1 if self._stack else 0  # K - 1 leaves stacked as K/2, K/4, ..., 1: one level up
        self._stack = [(level, self._final)]
        self._final = []
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
        _, sums = self._stack.pop()
        handles, self._handles = self._handles, []
        levels = self.groups[1:] if handles else self.groups  # the first level ran during the backward
        for bucket in range(len(self._buckets)):
            reduced = None
            if handles:
                handles[bucket].wait()
                reduced = self._roots[bucket]
            elif self.groups:
                reduced = self._gather(bucket, sums)
            for groups in levels:  # two processes per level: one addition, commutative
                dist.all_reduce(reduced, group=groups[self.rank])  # type: ignore[arg-type]
            self._scatter(bucket, reduced, sums, divide_by)
        self._roots = []
        self.added = 0


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
