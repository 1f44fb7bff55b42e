"""World-size-invariant FSDP2: the micro-batch gradients summed over the fixed tree, then each rank's shard kept.

FSDP2 reduce-scatters each micro-batch's gradient (ring or tree order of the backend: another sum on another number
of ranks). Under the invariant mode (:mod:`~lightning_determinism.invariance.invariant`) every ``FSDPModule`` gets a
custom reduce-scatter (``FSDPModule.set_custom_reduce_scatter``, public since torch 2.8) that does not reduce when it
is called: it takes its input, the micro-batch's whole flat gradient of the module's parameters, as a leaf of the
fixed binary tree over the step's ``M`` micro-batches (this rank's ``K`` leaves form a subtree), and outputs zeros.
At the step's last micro-batch it closes the subtree, climbs the tree with the other ranks in two-process
all-reduces (:func:`~lightning_determinism.invariance.tree.pair_groups`: a single addition per element, the same
bits on both), divides by the world size and outputs this rank's chunk. FSDP2 adds the outputs into the sharded
gradients (``0 + ... + 0 + g``); the chunk is normalised with ``+ 0.0`` (as the gradient tree's result is under
``ModelParallelStrategy``) so that one rank, many ranks and a model that is not ``fully_shard``-ed on one process
agree on the sign of a zero. The sums are exactly the ones one process takes over the same tree, element by element,
whatever the flat layout: the sharded parameters then step, element by element, as one process's do.

Cost: the whole flat gradient of each module lives until the step's end (``log2(K) + 1`` of them at most), and the
tree moves ``log2(W)`` whole gradients per rank instead of a reduce-scatter's ``(W - 1) / W`` of one: measured in
``benchmarks/invariance.py``. On one process FSDP2 calls no reduce-scatter at all; there the invariant mode's own
:class:`~lightning_determinism.invariance.tree.GradientTree` sums the (then whole) sharded gradients over the same
tree.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_determinism._compat.checks import require
from lightning_determinism._compat.features import INVARIANT_FSDP2
from lightning_determinism.invariance.tree import pair_groups


def fsdp_modules(module: torch.nn.Module) -> list[Any]:
    """The ``FSDPModule``s (``fully_shard``-ed modules) in ``module``, itself included."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


class TreeReduceScatter:
    """FSDP2's reduce-scatter for one ``FSDPModule``, summing the step's micro-batches over the fixed tree.

    Args:
        last_micro_batch: says whether the backward running now is the step's last micro-batch on this rank.
        leaves: ``K``, this rank's micro-batches per step.
        groups: :func:`~lightning_determinism.invariance.tree.pair_groups` of the world.
        rank, world_size: this rank's place.
    """

    def __init__(self, last_micro_batch: Callable[[], bool], leaves: int, groups: Sequence[Any], rank: int,
                 world_size: int) -> None:  # fmt: skip
        self.last_micro_batch, self.leaves = last_micro_batch, leaves
        self.groups, self.rank, self.world_size = groups, rank, world_size
        self._stack: list[tuple[int, torch.Tensor]] = []  # (level, subtree sum): a binary counter of leaves
        self.added = 0

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A plain buffer for FSDP2's flat input and output."""
        return torch.empty(*size, dtype=dtype, device=device)

    def _add_leaf(self, leaf: torch.Tensor) -> None:
        value, level = leaf, 0
        while self._stack and self._stack[-1][0] == level:
            _, left = self._stack.pop()
            value = left.add_(value)  # left + right, in the left subtree's tensor
            level += 1
        self._stack.append((level, value))
        self.added += 1

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> None:  # fmt: skip
        """Take the micro-batch's flat gradient as a leaf; at the step's last, output this rank's chunk of the mean."""
        self._add_leaf(input_tensor.clone())  # FSDP2 reuses its buffer
        if not self.last_micro_batch():
            output_tensor.zero_()
            return None
        if len(self._stack) != 1 or self.added != self.leaves:
            raise RuntimeError(
                f"world-size-invariant FSDP2: the step's last micro-batch closed a tree of {self.added} leaves,"
                f" expected {self.leaves} (one reduce-scatter per micro-batch: gradient sync must stay on)"
            )
        total = self._stack.pop()[1]
        self.added = 0
        for level in self.groups:  # climb: one addition per element with the partner, the same bits on both
            dist.all_reduce(total, group=level[self.rank])
        total.div_(self.world_size)
        chunk = total.view(self.world_size, -1)[self.rank]
        torch.add(chunk, 0.0, out=output_tensor)  # -0.0 -> 0.0, as FSDP2's 0 + ... + g gives with more leaves
        return None


def install_tree_reduce_scatter(
    module: torch.nn.Module,
    last_micro_batch: Callable[[], bool],
    leaves: int,
    rank: int,
    world_size: int,
    groups: Sequence[Any] | None = None,
) -> int:
    """Give every ``FSDPModule`` in ``module`` a :class:`TreeReduceScatter`.

    ``groups``: the world's :func:`~lightning_determinism.invariance.tree.pair_groups`; ``None`` creates them (a
    collective).

    Returns:
        How many modules got one.
    """
    modules = fsdp_modules(module)
    if modules:
        require(INVARIANT_FSDP2)
    if groups is None:
        groups = pair_groups(world_size) if world_size > 1 else []
    for fsdp_module in modules:
        fsdp_module.set_custom_reduce_scatter(TreeReduceScatter(last_micro_batch, leaves, groups, rank, world_size))
    return len(modules)


__all__ = ["TreeReduceScatter", "fsdp_modules", "install_tree_reduce_scatter"]
