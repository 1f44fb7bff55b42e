"""What reducing one optimizer step's gradients costs a process: bytes sent, collective rounds, gradient memory.

A model of the world-size-invariant reduction (:mod:`~lightning_determinism.invariance.tree` under DDP,
:mod:`~lightning_determinism.invariance.fsdp` under FSDP2), of release 0.1.0's, and of the stock reductions they
replace, for ``N`` gradient bytes, ``W`` processes and ``M`` micro-batches per step (``K = M / W`` per process). Sent
bytes count what leaves a process in the bandwidth-optimal form of each collective (a ring all-reduce sends
``2 (W - 1) / W * N``, a reduce-scatter or an all-to-all ``(W - 1) / W * N``, an all-gather of chunks
``(W - 1) / W * N``); FSDP2's all-gathers of parameters are the same in all three and left out.

- stock: DDP sends ``2 (W-1)/W N`` in 1 round and holds ``N``; FSDP2 sends ``K (W-1)/W N`` in ``K`` rounds (a
  reduce-scatter per micro-batch) and holds ``N / W`` (the sharded gradient);
- invariant: DDP sends ``2 (W-1)/W N`` in 2 rounds (all-to-all, all-gather; on 2 processes one all-reduce) and
  holds ``L N``; FSDP2 sends ``K (W-1)/W N`` in ``K`` rounds (an all-to-all per micro-batch) and holds
  ``N / W + L N / W``;
- 0.1.0: both send ``log2(W) N`` in ``log2(W)`` rounds; DDP holds ``L N``, FSDP2 ``N / W + L N``;

with ``L = log2(K) + 1``: the subtree sums a process keeps between micro-batches at most. Rounds are sequential
collectives per bucket (DDP) or per module (FSDP2) and step. Transient receive buffers come on top: the
invariant DDP's all-to-all receives ``N`` (over all its buckets), FSDP2's one module's gradient at a time (as
FSDP2's own reduce-scatter input is). ``tests/invariance/test_invariant_scale.py`` checks the sent bytes and the held
shards against counted ones; ``benchmarks/invariant_scale.py`` prints this model at cluster sizes.

This module is a leaf: it knows neither torch nor Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass

STRATEGIES = ("ddp", "fsdp2")
REDUCTIONS = ("stock", "invariant", "0.1.0")


@dataclass(frozen=True)
class ReductionCost:
    """One process's cost of reducing one optimizer step's gradients (see the module's table)."""

    bytes_sent: float
    """Bytes the process sends."""
    rounds: int
    """Sequential collective rounds per bucket (DDP) or per module (FSDP2)."""
    gradient_bytes: float
    """Gradient bytes the process holds at its peak between micro-batches (transient receive buffers aside)."""


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer, got {value!r}")
    return value


def reduction_cost(
    strategy: str, reduction: str, world_size: int, micro_batches: int, gradient_bytes: float
) -> ReductionCost:
    """The cost of ``reduction`` under ``strategy`` on ``world_size`` processes (see the module's table).

    Args:
        strategy: ``"ddp"`` or ``"fsdp2"``.
        reduction: ``"stock"`` (DDP's all-reduce, FSDP2's reduce-scatter per micro-batch), ``"invariant"`` (this
            release) or ``"0.1.0"`` (the tree of two-process all-reduces of whole gradients).
        world_size: ``W``, a power of two that divides ``micro_batches``.
        micro_batches: ``M``, micro-batches per optimizer step over all processes.
        gradient_bytes: ``N``, the whole model's gradient bytes.

    Raises:
        ValueError: naming the argument, what it must be and the value received.

    Examples:
        >>> seven_b = 7e9 * 4  # float32 gradients
        >>> reduction_cost("ddp", "0.1.0", 1024, 1024, seven_b).bytes_sent / seven_b
        10.0
        >>> round(reduction_cost("ddp", "invariant", 1024, 1024, seven_b).bytes_sent / seven_b, 3)
        1.998
        >>> reduction_cost("fsdp2", "invariant", 64, 1024, seven_b).gradient_bytes / 1e9  # 6 shards of 0.44 GB
        2.625
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"`strategy` must be one of {STRATEGIES}, got {strategy!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"`reduction` must be one of {REDUCTIONS}, got {reduction!r}")
    world = _positive_int("world_size", world_size)
    micro = _positive_int("micro_batches", micro_batches)
    if world & (world - 1) or micro % world:
        raise ValueError(
            f"`world_size` must be a power of two that divides `micro_batches` ({micro}), got {world_size}"
        )
    if not gradient_bytes > 0:
        raise ValueError(f"`gradient_bytes` must be positive, got {gradient_bytes!r}")
    n, per_rank = float(gradient_bytes), micro // world
    levels = per_rank.bit_length()  # log2(K) + 1 for a power of two: the most subtree sums a binary counter holds
    tree_rounds = world.bit_length() - 1
    if strategy == "ddp":
        if reduction == "stock":
            return ReductionCost(2 * (world - 1) / world * n, 1, n)
        if reduction == "invariant":
            return ReductionCost(2 * (world - 1) / world * n, min(world - 1, 2), levels * n)  # W = 2: one all-reduce
        return ReductionCost(tree_rounds * n, tree_rounds, levels * n)
    shard = n / world
    if reduction == "stock":
        return ReductionCost(per_rank * (world - 1) / world * n, per_rank if world > 1 else 0, shard)
    if reduction == "invariant":
        return ReductionCost(per_rank * (world - 1) / world * n, per_rank if world > 1 else 0, shard + levels * shard)
    return ReductionCost(tree_rounds * n, tree_rounds, shard + levels * n)


__all__ = ["REDUCTIONS", "STRATEGIES", "ReductionCost", "reduction_cost"]
