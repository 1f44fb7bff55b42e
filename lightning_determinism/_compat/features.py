"""The package's features, each with the versions it is tested on: what a missing private piece takes away.

:mod:`~lightning_determinism._compat.pieces` gives each private piece one of these; a feature refuses when one of its
pieces is missing (:func:`~lightning_determinism._compat.checks.require`). A leaf: imports nothing of the package.
"""

from __future__ import annotations

LIGHTNING_FLOOR = "2.5.0"
"""Older Lightning replays an epoch's last batch on resume from a checkpoint written at that batch (its fit loop took
the batch for unfinished), so a resumed run is not the uninterrupted one; fixed in 2.5.0 (Lightning PR #20379)."""


TORCH_FLOOR = "2.8"
"""The oldest torch the suite passes on (docs/compatibility.md); some features need a newer one (:data:`FEATURES`)."""
TESTED = f"torch {TORCH_FLOOR} to 2.15, lightning {LIGHTNING_FLOOR} to 2.6"
"""Where every feature works unless its :data:`FEATURES` entry says otherwise."""

TRAINER = "the deterministic Trainer strategies"
FABRIC = "the deterministic Fabric strategies"
MODEL_PARALLEL = "the model-parallel strategies (FSDP2 + tensor parallel)"
DTENSOR = "DTensor random ops and shard positions (tensor parallel)"
INVARIANT_FSDP2 = "world-size-invariant FSDP2 (gradients reduced in a fixed tree)"
UNEVEN_STRIDED = "uneven FSDP2 x tensor-parallel shards"
RECOMPUTE = "replaying the package's streams in activation checkpointing"
WORKERS = "data-loader worker seeding, replay and watchdog"
PREEMPTION = "PreemptionCheckpoint and stopping inside an evaluation pass"
BASELINE = "numerical baselines (NumericalBaseline, BaselineRecorder)"
INVARIANT = "world-size-invariant training (clipping, the batch-norm check)"
KERNEL = "the compiled perplexity kernel"
METRICS = "the exact metrics (DistributedPerplexity, DistributedMean)"
PLOTS = "the exact metrics' plot() types"
BATCH_INVARIANT = "batch-invariant evaluation (kernels registered over ATen's)"

NEWER_TORCH: dict[str, str] = {INVARIANT_FSDP2: "2.9", UNEVEN_STRIDED: "2.10"}
"""The features that need a torch newer than :data:`TORCH_FLOOR`: there they refuse, the rest of the package works."""

FEATURES: dict[str, str] = {
    TRAINER: TESTED,
    FABRIC: TESTED,
    MODEL_PARALLEL: TESTED,
    DTENSOR: TESTED,
    INVARIANT_FSDP2: "torch 2.9 to 2.15 (FSDPModule.set_custom_reduce_scatter), lightning 2.5.0 to 2.6",
    UNEVEN_STRIDED: "torch 2.10 to 2.15 (older ones gather such shards into wrong values), lightning 2.5.0 to 2.6",
    RECOMPUTE: TESTED,
    WORKERS: TESTED,
    PREEMPTION: TESTED,
    BASELINE: TESTED,
    INVARIANT: TESTED,
    KERNEL: TESTED,
    METRICS: f"{TESTED}, torchmetrics 1.4 to 1.9",
    PLOTS: "torchmetrics 1.4 to 1.9",
    BATCH_INVARIANT: TESTED,
}
"""Each feature and the versions it is tested on (docs/compatibility.md has the table)."""

__all__ = [
    "BASELINE",
    "BATCH_INVARIANT",
    "DTENSOR",
    "FABRIC",
    "FEATURES",
    "INVARIANT",
    "INVARIANT_FSDP2",
    "KERNEL",
    "LIGHTNING_FLOOR",
    "METRICS",
    "MODEL_PARALLEL",
    "NEWER_TORCH",
    "PLOTS",
    "PREEMPTION",
    "RECOMPUTE",
    "TESTED",
    "TORCH_FLOOR",
    "TRAINER",
    "UNEVEN_STRIDED",
    "WORKERS",
]
