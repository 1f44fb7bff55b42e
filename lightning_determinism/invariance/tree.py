"""A fixed binary tree of gradient sums: the same bits for any split of its leaves over power-of-two process counts.

The leaves are the micro-batch gradients of one optimizer step, in micro-batch order ``0 .. M-1`` (``M`` a power of
two). Their sum is the balanced pairwise tree: ``((g0 + g1) + (g2 + g3)) + ...``. A process holding the contiguous
leaves ``r*K .. r*K + K - 1`` (``K = M / W``, a power of two) computes its subtree as the leaves arrive; the ``W``
subtrees are then added over the tree's top ``log2(W)`` levels by chunks
(:class:`~lightning_determinism.invariance.exchange.ChunkExchange`): one ``all_to_all`` gives each process the
``1/W`` of the gradient it owns from every process, it adds those ``W`` subtrees in the tree's order, and one
``all_gather`` returns every chunk to every process. Every element is added exactly as one process adds it: the sum
is the one-process tree's, bit for bit (and 0.1.0's, whose processes climbed the same levels with two-process
all-reduces of the whole gradient).

Cost per process and optimizer step, for ``N`` gradient bytes: ``2 (W - 1) / W * N`` sent (a ring all-reduce's
volume; 0.1.0 sent ``log2(W) * N``), two collective rounds per bucket whatever ``W`` (one on two processes), the
first started during the step's last backward, bucket by bucket, as DDP's buckets are. Memory: the ``log2(K) + 1``
sets of subtree sums live in the gradient tensors autograd allocated; a bucket of several parameters (or of a size
``W`` does not divide) is copied into one flat vector, and each bucket's receive buffer lives until its chunk is
summed.

Sums are taken in the gradients' own dtype (float32): the tree's error grows with ``log2(M)``, not with ``M`` as the
sequential accumulation of DDP does (``benchmarks/invariance.py`` measures both against float64).

This module is a leaf: it knows ``torch.distributed``, not Lightning.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_determinism.invariance.exchange import ChunkExchange, padded_numel

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


class GradientTree:
    """One process's part of the fixed tree over an optimizer step's micro-batch gradients.

    The tree is kept per parameter, in the gradient tensors autograd allocated: a leaf takes each parameter's
    ``.grad`` (and clears it, so that the next backward allocates a new one), and a right child is added in place
    into its left sibling. At the step's end the processes' subtrees are added by chunks
    (:class:`~lightning_determinism.invariance.exchange.ChunkExchange`), bucket by bucket; a bucket is sent from its
    parameter's own tensor where it is one parameter that ``W`` divides, else from a flat copy.

    Args:
        parameters: the parameters whose gradients are summed, in a fixed order.
        leaves: ``K``, this process's micro-batches per step (a power of two).
        world_size: ``W``, the processes (a power of two).
        group: the process group of the ``W`` processes (``None``: the default one).
        bucket_bytes: gradient bytes per bucket of communication.

    Examples:
        >>> p = torch.nn.Parameter(torch.zeros(2))
        >>> tree = GradientTree([p], leaves=2)
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
        world_size: int = 1,
        group: Any = None,
        bucket_bytes: int = BUCKET_BYTES,
    ) -> None:
        self.parameters = list(parameters)
        self.leaves, self.world_size, self.group = leaves, world_size, group
        self.positive_zeros = False  # set under FSDP2: its sum of a step's gradients has no -0.0 (invariance.fsdp)
        self._stack: list[tuple[int, list[Tensor]]] = []
        self.added = 0
        self._buckets = _buckets(self.parameters, bucket_bytes)
        self._bucket_of = {i: b for b, members in enumerate(self._buckets) for i in members}
        self._staging: dict[int, Tensor] = {}  # flat vectors of the buckets that are not one parameter's tensor
        # The overlapped last leaf (see arm()): what each bucket still waits for, the sums it closed per parameter,
        # the flat tensor each bucket sends, the hooks, the started exchanges.
        self._pending: list[int] = []
        self._final: list[Tensor] = []
        self._sent: list[Tensor | None] = []
        self._hooks: list[Any] = []
        self._exchanges: list[ChunkExchange] = []

    def _take(self, index: int) -> Tensor:
        """Parameter ``index``'s gradient, from now on the tree's; a parameter without one contributes zeros."""
        p = self.parameters[index]
        grad = p.grad
        p.grad = None
        return torch.zeros_like(p) if grad is None else grad

    def arm(self) -> None:
        """Overlap the coming micro-batch, the step's last, with the exchange's first round.

        Each bucket of parameters (filled in the backward's order) is added into the tree and its ``all_to_all``
        started as soon as the backward has produced all its gradients, while the backward goes on with the next ones
        (as DDP's buckets are). The additions and their order are those of :meth:`add_leaf`: the bits do not change.
        Without other processes there is nothing to overlap.
        """
        if self.world_size == 1 or self._hooks or self.added != self.leaves - 1:
            return
        self._pending = [len(members) for members in self._buckets]
        self._final = [torch.empty(0)] * len(self.parameters)
        self._sent = [None] * len(self._buckets)
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
        """Add one bucket's gradients as the last leaf and start the bucket's ``all_to_all``."""
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
        self._sent[bucket] = self._gather(bucket, self._final)
        # Collectives start in bucket order on every process (as DDP's do), whatever order the buckets filled in.
        while len(self._exchanges) < len(self._buckets) and self._sent[len(self._exchanges)] is not None:
            self._exchanges.append(self._exchange(self._sent[len(self._exchanges)]))  # type: ignore[arg-type]

    def _exchange(self, flat: Tensor) -> ChunkExchange:
        return ChunkExchange(flat, self.world_size, group=self.group, tree=True)

    def _gather(self, bucket: int, sums: Sequence[Tensor]) -> Tensor:
        """What carries ``bucket`` through the exchange: a lone parameter's own sum, else a flat (padded) copy."""
        members = self._buckets[bucket]
        lone = sums[members[0]]
        if len(members) == 1 and lone.is_contiguous() and lone.numel() % self.world_size == 0:
            return lone.view(-1)
        flat = self._staging.get(bucket)
        if flat is None:
            first = self.parameters[members[0]]
            numel = padded_numel(sum(self.parameters[i].numel() for i in members), self.world_size)
            flat = self._staging[bucket] = torch.zeros(numel, dtype=first.dtype, device=first.device)
        offset = 0
        for i in members:
            n = self.parameters[i].numel()
            flat[offset : offset + n].view(self.parameters[i].shape).copy_(sums[i])
            offset += n
        return flat

    def _scatter(self, bucket: int, reduced: Tensor | None, sums: Sequence[Tensor], divide_by: int) -> None:
        """Set a bucket's mean gradients, each in its parameter's tensor.

        ``reduced``: the exchanged flat tensor, divided already (``None`` without other processes: the sums are in
        place and are divided here, exactly, by a power of two).
        """
        flat = reduced if reduced is not None and reduced is self._staging.get(bucket) else None
        offset = 0
        for i in self._buckets[bucket]:
            p, total = self.parameters[i], sums[i]
            if flat is not None:  # a flat copy: back into the parameter's own tensor
                total.copy_(flat[offset : offset + p.numel()].view(p.shape))
                offset += p.numel()
            elif reduced is None:
                if divide_by != 1:
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
        """Add the processes' subtrees by chunks, divide the root exactly, and set it as the gradients.

        Raises:
            RuntimeError: if this process took another number of leaves than it owns.
        """
        if self.added != self.leaves or len(self._stack) != 1:
            raise RuntimeError(
                f"the gradient tree took {self.added} micro-batches in this step, expected {self.leaves}"
            )
        _, sums = self._stack.pop()
        exchanges, self._exchanges, self._sent = self._exchanges, [], []
        self.added = 0
        if self.world_size == 1:
            for bucket in range(len(self._buckets)):
                self._scatter(bucket, None, sums, divide_by)
            return
        if not exchanges:  # not overlapped: every bucket's all_to_all starts now, in bucket order
            exchanges = [self._exchange(self._gather(bucket, sums)) for bucket in range(len(self._buckets))]
        for exchange in exchanges:  # each bucket's all_gather starts as soon as its chunk is summed
            exchange.reduce(divide_by, self.positive_zeros)
        for bucket, exchange in enumerate(exchanges):
            self._scatter(bucket, exchange.wait(), sums, divide_by)


class PairwiseAllReduce:
    """A DDP communication hook whose sums do not depend on where a gradient sits in its bucket.

    A ring all-reduce over more than two processes adds each element's ``W`` terms in an order set by the chunk of the
    flat bucket the element falls in; DDP rebuilds its buckets after the first step of every run (in the order the
    gradients became ready), so the first steps of a resumed run put gradients elsewhere than the uninterrupted run,
    and their sums differ in the last bits. Here every element's ``W`` terms are added in one fixed order wherever it
    sits, by chunks (:class:`~lightning_determinism.invariance.exchange.ChunkExchange`: a ring all-reduce's volume,
    two rounds): the balanced tree ``(g0 + g1) + (g2 + g3)`` for a power-of-two ``W``, rank order otherwise. Each
    bucket is divided by ``W`` first, as DDP's default hook does.

    Args:
        world_size: the number of processes (more than two: with two, DDP's own sum is one addition already).
        rank: this process's rank.
    """

    def __init__(self, world_size: int, rank: int) -> None:
        self.world_size, self.rank = world_size, rank
        self.power_of_two = world_size & (world_size - 1) == 0

    def reduce(self, state: object, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
        """Reduce ``bucket`` in place (blocking: the chunks are summed between the two rounds)."""
        buffer = bucket.buffer()
        buffer.div_(self.world_size)
        numel = buffer.numel()
        flat = buffer if numel % self.world_size == 0 else torch.zeros(
            padded_numel(numel, self.world_size), dtype=buffer.dtype, device=buffer.device
        )  # fmt: skip
        if flat is not buffer:
            flat[:numel].copy_(buffer)
        exchange = ChunkExchange(flat, self.world_size, tree=self.power_of_two)
        exchange.reduce()
        total = exchange.wait()
        if total is not buffer:
            buffer.copy_(total[:numel])
        future: torch.futures.Future[Tensor] = torch.futures.Future()
        future.set_result(buffer)
        return future


# DDP checks a hook's annotations as objects; this module's annotations are strings (postponed evaluation).
PairwiseAllReduce.reduce.__annotations__ = {
    "state": object,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}

__all__ = ["GradientTree", "PairwiseAllReduce", "tree_sum"]
