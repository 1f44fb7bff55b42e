"""Lightning callbacks: seeding, RNG state in checkpoints, preemption, replicas, baselines, the records."""

from lightning_determinism.callbacks.baseline import NumericalBaseline
from lightning_determinism.callbacks.determinism_record import DeterminismRecord
from lightning_determinism.callbacks.preemption import PreemptionCheckpoint
from lightning_determinism.callbacks.replica_guard import ReplicaGuard
from lightning_determinism.callbacks.rng_checkpoint import RNGStateCheckpoint
from lightning_determinism.callbacks.sample_record import SampleRecord
from lightning_determinism.callbacks.worker_seed import WorkerSeedCallback

__all__ = [
    "DeterminismRecord",
    "NumericalBaseline",
    "PreemptionCheckpoint",
    "RNGStateCheckpoint",
    "ReplicaGuard",
    "SampleRecord",
    "WorkerSeedCallback",
]
