"""A sum over the ranks by chunks, in a fixed order: the bits of a fixed tree at the bandwidth of a ring all-reduce.

Every rank holds a flat tensor of ``W * c`` elements (its term of the sum). One ``all_to_all`` hands rank ``r`` the
``r``-th chunk of every rank's tensor: ``W`` rows of ``c`` elements, row ``s`` from rank ``s``. Rank ``r`` adds its
rows in a fixed order -- the balanced pairwise tree ``((t0 + t1) + (t2 + t3)) + ...`` for a power-of-two ``W``, rank
order ``((t0 + t1) + t2) + ...`` otherwise -- and one ``all_gather`` brings every rank every chunk's sum. Each element
is added in the same order as by one process holding all ``W`` terms, whichever rank owns its chunk: the same bits
on every rank, and the same bits as 0.1.0's climb of two-process all-reduces over the same tree.

Cost per rank, for ``N`` bytes: ``(W - 1) / W * N`` sent by the ``all_to_all`` and as much by the ``all_gather`` --
``2 (W - 1) / W * N``, a ring all-reduce's volume -- in two collective rounds whatever ``W`` (the tree of two-process
all-reduces sent ``log2(W) * N`` in ``log2(W)`` rounds). On two ranks, where each sum is one addition, the backend's
all-reduce sends the same ``N`` in one round. Memory: one receive buffer of ``N`` while the chunk is
summed. Both collectives exist in gloo and NCCL (``all_to_all_single``, ``all_gather_single`` /
``all_gather_into_tensor``).

This module is a leaf: it knows ``torch.distributed``, not Lightning.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def padded_numel(numel: int, world_size: int) -> int:
    """The smallest multiple of ``world_size`` that holds ``numel`` elements: ``W`` equal chunks.

    Examples:
        >>> padded_numel(10, 4), padded_numel(12, 4)
        (12, 12)
    """
    return -(-numel // world_size) * world_size


def add_rows_in_tree(rows: Tensor) -> Tensor:
    """The balanced pairwise tree over the rows of ``rows`` (a power-of-two count), in place; returns row 0.

    Level by level, ``rows[i] += rows[i + span]``: ``log2(W)`` element-wise additions, one kernel per level.

    Examples:
        >>> add_rows_in_tree(torch.tensor([[1.0], [2.0], [3.0], [4.0]]))
        tensor([10.])
    """
    span, count = 1, rows.shape[0]
    while span < count:
        rows[0::2 * span].add_(rows[span::2 * span])  # fmt: skip
        span *= 2
    return rows[0]


def add_rows_in_order(rows: Tensor) -> Tensor:
    """``((r0 + r1) + r2) + ...`` over the rows of ``rows``, in place; returns row 0.

    Examples:
        >>> add_rows_in_order(torch.tensor([[1.0], [2.0], [3.0]]))
        tensor([6.])
    """
    total = rows[0]
    for index in range(1, rows.shape[0]):
        total.add_(rows[index])
    return total


def all_gather_flat(output: Tensor, chunk: Tensor, group: Any = None, async_op: bool = False) -> Any:
    """``all_gather`` of equal chunks into one flat tensor (``all_gather_single`` where torch has it).

    A backend without the flat form (gloo in older torch releases) gathers into views of ``output`` instead: the
    same bytes in the same places.
    """
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    try:
        return gather(output, chunk, group=group, async_op=async_op)
    except RuntimeError as err:
        if "support" not in str(err):
            raise
    rows = list(output.view(-1, chunk.numel()).unbind(0))
    return dist.all_gather(rows, chunk, group=group, async_op=async_op)


class ChunkExchange:
    """One flat tensor summed over the ranks by chunks; started at construction, the ``all_to_all`` in flight.

    On two ranks each element's sum is one addition, the same bits in either order: the backend's all-reduce gives
    it in one round (the same volume, all of it overlapped where the exchange starts during a backward).

    Args:
        flat: this rank's term, ``W * c`` elements; it receives the sum (all chunks) when :meth:`wait` returns.
        world_size: ``W``, the ranks of ``group``.
        group: the process group (``None``: the default one).
        tree: add the rows in the balanced tree (a power-of-two ``W``), else in rank order.

    Examples:
        >>> exchange = ChunkExchange(torch.tensor([1.0, 2.0]), world_size=1)  # one process: nothing to send
        >>> exchange.reduce(divide_by=2)
        >>> exchange.wait()
        tensor([0.5000, 1.0000])
    """

    def __init__(self, flat: Tensor, world_size: int, group: Any = None, tree: bool = True) -> None:
        if flat.numel() % world_size:
            raise ValueError(f"`flat` must hold a multiple of world_size={world_size} elements, got {flat.numel()}")
        self.flat, self.world_size, self.group, self.tree = flat, world_size, group, tree
        self._received: Tensor | None = None
        self._work: Any = None
        self._summed_by_backend = world_size == 2
        if self._summed_by_backend:  # one addition per element, a + b = b + a: the backend's all-reduce, one round
            self._work = dist.all_reduce(flat, group=group, async_op=True)
        elif world_size > 1:
            self._received = torch.empty_like(flat)
            self._work = dist.all_to_all_single(self._received, flat, group=group, async_op=True)

    def reduce(self, divide_by: int = 1, positive_zeros: bool = False) -> None:
        """Add this rank's chunk's ``W`` terms, divide (a power of two: exact), start the ``all_gather``.

        ``positive_zeros``: end with ``+ 0.0`` (``-0.0`` becomes ``0.0``), element-wise, as FSDP2's sums are.
        """
        if self._summed_by_backend:
            self._work.wait()
            self._work = None
            mine = self.flat
        elif self._received is None:
            mine = self.flat
        else:
            self._work.wait()
            rows = self._received.view(self.world_size, -1)
            mine = add_rows_in_tree(rows) if self.tree else add_rows_in_order(rows)
        if divide_by != 1:
            mine.div_(divide_by)
        if positive_zeros:
            mine.add_(0.0)
        if self._received is not None:
            self._work = all_gather_flat(self.flat, mine, group=self.group, async_op=True)

    def wait(self) -> Tensor:
        """The sum, in ``flat``, once the ``all_gather`` is done (the receive buffer is freed)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        self._received = None
        return self.flat


__all__ = ["ChunkExchange", "add_rows_in_order", "add_rows_in_tree", "all_gather_flat", "padded_numel"]
