"""Lightning callbacks: worker seeding (and, later, RNG-state checkpointing and numerical baselines)."""

from lightning_determinism.callbacks.baseline import NumericalBaseline
from lightning_determinism.callbacks.rng_checkpoint import RNGStateCheckpoint
from lightning_determinism.callbacks.worker_seed import WorkerSeedCallback

__all__ = ["NumericalBaseline", "RNGStateCheckpoint", "WorkerSeedCallback"]
