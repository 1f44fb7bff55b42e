"""Lightning callbacks: worker seeding (and, later, RNG-state checkpointing and numerical baselines)."""

from lightning_determinism.callbacks.worker_seed import WorkerSeedCallback

__all__ = ["WorkerSeedCallback"]
