"""Reproducible PyTorch Lightning training and evaluation across ranks, nodes, restarts and workers.

Importing the package registers the deterministic strategies in Lightning's ``StrategyRegistry``
(``ddp_deterministic``, ``ddp_spawn_deterministic``, ``ddp_fork_deterministic``, ``fsdp_deterministic``, ...).
"""

from lightning_determinism.__about__ import __version__
from lightning_determinism.backends import configure_determinism, determinism_report
from lightning_determinism.callbacks import NumericalBaseline, RNGStateCheckpoint, WorkerSeedCallback
from lightning_determinism.errors import DeterminismWarning
from lightning_determinism.fingerprint import fingerprint
from lightning_determinism.metrics import DistributedMean, DistributedPerplexity, perplexity
from lightning_determinism.seeding import derive_seed, set_seed
from lightning_determinism.strategies import (
    DeterministicDDPStrategy,
    DeterministicFSDPStrategy,
    DeterministicSingleDeviceStrategy,
    DeterministicStrategyMixin,
    register_strategies,
)

register_strategies()

__all__ = [
    "DeterminismWarning",
    "DeterministicDDPStrategy",
    "DeterministicFSDPStrategy",
    "DeterministicSingleDeviceStrategy",
    "DeterministicStrategyMixin",
    "DistributedMean",
    "DistributedPerplexity",
    "NumericalBaseline",
    "RNGStateCheckpoint",
    "WorkerSeedCallback",
    "__version__",
    "configure_determinism",
    "derive_seed",
    "determinism_report",
    "fingerprint",
    "perplexity",
    "set_seed",
]
