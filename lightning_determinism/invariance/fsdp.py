"""World-size-invariant FSDP2: each rank sums its chunk of the micro-batch gradients over the fixed tree.

FSDP2 reduce-scatters each micro-batch's gradient (ring or tree order of the backend: another sum on another number
of ranks). Under the invariant mode (:mod:`~lightning_determinism.invariance.invariant`) rank ``r`` runs micro-batches
``j*W + r`` of a step (``j = 0 .. K-1``: strided, as ``DistributedSampler`` deals samples), so that pass ``j`` of the
``W`` ranks covers the ``W`` adjacent leaves ``j*W .. j*W + W - 1`` of the fixed binary tree over the step's ``M``
micro-batches. Every ``FSDPModule`` gets a custom reduce-scatter (``FSDPModule.set_custom_reduce_scatter``, public
since torch 2.8) that replaces the reduce-scatter by one ``all_to_all`` of the same volume: rank ``r`` receives the
``r``-th chunk (its shard) of each rank's flat gradient -- those ``W`` adjacent leaves -- and adds them in the tree's
order into a subtree of ``W`` leaves (:func:`~lightning_determinism.invariance.exchange.add_rows_in_tree`). Over the
step's ``K`` passes these subtrees are added as a binary counter, and the step's last pass closes the root of the
rank's chunk, which is divided by the world size and output; earlier passes output zeros. FSDP2 adds the outputs into
the sharded gradients (``0 + ... + 0 + g``); the chunk is normalised with ``+ 0.0`` (as the gradient tree's result is
under ``ModelParallelStrategy``) so that one rank, many ranks and a model that is not ``fully_shard``-ed on one process
agree on the sign of a zero. Every element is added exactly as one process adds it over the same tree, whatever the
flat layout: the sharded parameters then step, element by element, as one process's do (and as under 0.1.0, whose
ranks kept whole gradients and climbed the tree with two-process all-reduces).

Cost per rank, for a module of ``N`` gradient bytes: ``(W - 1) / W * N`` sent per micro-batch in one round (FSDP2's
own reduce-scatter volume); between micro-batches at most ``log2(K) + 1`` chunks of ``N / W`` (subtree sums), beside
FSDP2's sharded gradient; during the call, a receive buffer of ``N`` (as large as FSDP2's own reduce-scatter input,
freed on return). On one process FSDP2 calls no reduce-scatter at all; there the invariant mode's own
:class:`~lightning_determinism.invariance.tree.GradientTree` sums the (then whole) sharded gradients over the same
tree. ``benchmarks/invariant_scale.py`` prints these figures beside stock FSDP2's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_determinism._compat.checks import require
from lightning_determinism._compat.features import INVARIANT_FSDP2
from lightning_determinism.invariance.exchange import add_rows_in_tree


def fsdp_modules(module: torch.nn.Module) -> list[Any]:
    """The ``FSDPModule``s (``fully_shard``-ed modules) in ``module``, itself included."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


class TreeReduceScatter:
    """FSDP2's reduce-scatter for one ``FSDPModule``, summing this rank's chunk of the step's micro-batches.

    Args:
        last_micro_batch: says whether the backward running now is the step's last micro-batch on this rank.
        leaves: ``K``, this rank's micro-batches per step (rank ``r`` runs micro-batches ``j*W + r``).
        world_size: ``W``, the ranks of FSDP2's reduce-scatter group.
    """

    def __init__(self, last_micro_batch: Callable[[], bool], leaves: int, world_size: int) -> None:
        self.last_micro_batch, self.leaves, self.world_size = last_micro_batch, leaves, world_size
        self._stack: list[tuple[int, torch.Tensor]] = []  # (level, chunk of a subtree sum): a binary counter
        self.added = 0

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A plain buffer for FSDP2's flat input and output."""
        return torch.empty(*size, dtype=dtype, device=device)

    def held_bytes(self) -> int:
        """The bytes of subtree sums kept between micro-batches (at most ``log2(K) + 1`` chunks)."""
        return sum(chunk.numel() * chunk.element_size() for _, chunk in self._stack)

    def _add_subtree(self, value: torch.Tensor) -> None:
        level = 0
        while self._stack and self._stack[-1][0] == level:
            _, left = self._stack.pop()
            value = left.add_(value)  # left + right, in the left subtree's chunk
            level += 1
        if value.storage_offset() != 0 or value.untyped_storage().nbytes() > value.numel() * value.element_size():
            value = value.clone()  # a view of the receive buffer: keep the chunk only
        self._stack.append((level, value))
        self.added += 1

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> None:  # fmt: skip
        """Add the ``W`` adjacent leaves of this rank's chunk; at the step's last, output the chunk of the mean."""
        received = torch.empty_like(input_tensor)
        dist.all_to_all_single(received, input_tensor, group=group)  # row s: rank s's leaf j*W + s, chunk r
        self._add_subtree(add_rows_in_tree(received.view(self.world_size, -1)))
        del received
        if not self.last_micro_batch():
            output_tensor.zero_()
            return None
        if len(self._stack) != 1 or self.added != self.leaves:
            raise RuntimeError(
                f"world-size-invariant FSDP2: the step's last micro-batch closed a tree of {self.added} passes,"
                f" expected {self.leaves} (one reduce-scatter per micro-batch: gradient sync must stay on)"
            )
        total = self._stack.pop()[1]
        self.added = 0
        total.div_(self.world_size)
        torch.add(total, 0.0, out=output_tensor)  # -0.0 -> 0.0, as FSDP2's 0 + ... + g gives with more leaves
        return None


def install_tree_reduce_scatter(
    module: torch.nn.Module, last_micro_batch: Callable[[], bool], leaves: int, world_size: int
) -> int:
    """Give every ``FSDPModule`` in ``module`` a :class:`TreeReduceScatter` (also kept as ``_ldet_reduce_scatter``).

    Returns:
        How many modules got one.
    """
    modules = fsdp_modules(module)
    if modules:
        require(INVARIANT_FSDP2)
    for fsdp_module in modules:
        scatter = TreeReduceScatter(last_micro_batch, leaves, world_size)
        fsdp_module.set_custom_reduce_scatter(scatter)
        fsdp_module._ldet_reduce_scatter = scatter  # what diagnostics and the tests read (held_bytes)
    return len(modules)


__all__ = ["TreeReduceScatter", "fsdp_modules", "install_tree_reduce_scatter"]
