"""Reproducible PyTorch Lightning training and evaluation across ranks, nodes, restarts and workers.

Importing the package registers the deterministic strategies in Lightning's ``StrategyRegistry`` and in Fabric's
(``ddp_deterministic``, ``ddp_spawn_deterministic``, ``ddp_fork_deterministic``, ``fsdp_deterministic``, ...).
Every public name the documentation uses can be imported from here.
"""

from lightning_determinism.__about__ import __version__
from lightning_determinism.backends import configure_determinism, determinism_report
from lightning_determinism.baseline_file import BaselineFileError, compare_baselines, load_baseline
from lightning_determinism.baseline_recorder import BaselineMismatch, BaselineRecorder
from lightning_determinism.callbacks import (
    NumericalBaseline,
    PreemptionCheckpoint,
    ReplicaGuard,
    RNGStateCheckpoint,
    WorkerSeedCallback,
)
from lightning_determinism.checkpoint_file import DamagedCheckpointError
from lightning_determinism.checkpoint_io import AtomicCheckpointIO
from lightning_determinism.data.samplers import UnpaddedDistributedSampler
from lightning_determinism.diagnosis import (
    DivergenceProbe,
    ProbeFileError,
    ProbeRecorder,
    bisect_checkpoints,
    diagnose,
    diagnose_checkpoints,
    load_probe,
)
from lightning_determinism.errors import DeterminismWarning, IncompatibleVersionError
from lightning_determinism.fabric import (
    DeterministicFabricDDPStrategy,
    DeterministicFabricFSDPStrategy,
    DeterministicFabricModelParallelStrategy,
    DeterministicFabricSingleDeviceStrategy,
    DeterministicFabricStrategyMixin,
    FabricRNGState,
    register_fabric_strategies,
)
from lightning_determinism.fingerprint import fingerprint, tensor_fingerprints
from lightning_determinism.isolation import evaluation_streams
from lightning_determinism.metrics import DistributedMean, DistributedPerplexity, perplexity
from lightning_determinism.model_parallel_strategy import (
    DeterministicModelParallelStrategy,
    register_model_parallel_strategy,
)
from lightning_determinism.rng import (
    RNGStatesTracker,
    capture_rng_state,
    generator,
    get_rng_tracker,
    restore_rng_state,
)
from lightning_determinism.seeding import derive_seed, set_seed
from lightning_determinism.strategies import (
    DeterministicDDPStrategy,
    DeterministicFSDPStrategy,
    DeterministicSingleDeviceStrategy,
    DeterministicStrategyMixin,
    register_strategies,
)
from lightning_determinism.topology import GroupInfo, Topology, model_parallel_seed, stream_seeds

register_strategies()
register_model_parallel_strategy()
register_fabric_strategies()

__all__ = [
    "AtomicCheckpointIO",
    "BaselineFileError",
    "BaselineMismatch",
    "BaselineRecorder",
    "DamagedCheckpointError",
    "DeterminismWarning",
    "DeterministicDDPStrategy",
    "DeterministicFSDPStrategy",
    "DeterministicFabricDDPStrategy",
    "DeterministicFabricFSDPStrategy",
    "DeterministicFabricModelParallelStrategy",
    "DeterministicFabricSingleDeviceStrategy",
    "DeterministicFabricStrategyMixin",
    "DeterministicModelParallelStrategy",
    "DeterministicSingleDeviceStrategy",
    "DeterministicStrategyMixin",
    "DistributedMean",
    "DistributedPerplexity",
    "DivergenceProbe",
    "FabricRNGState",
    "GroupInfo",
    "IncompatibleVersionError",
    "NumericalBaseline",
    "PreemptionCheckpoint",
    "ProbeFileError",
    "ProbeRecorder",
    "RNGStateCheckpoint",
    "RNGStatesTracker",
    "ReplicaGuard",
    "Topology",
    "UnpaddedDistributedSampler",
    "WorkerSeedCallback",
    "__version__",
    "bisect_checkpoints",
    "capture_rng_state",
    "compare_baselines",
    "configure_determinism",
    "derive_seed",
    "determinism_report",
    "diagnose",
    "diagnose_checkpoints",
    "evaluation_streams",
    "fingerprint",
    "generator",
    "get_rng_tracker",
    "load_baseline",
    "load_probe",
    "model_parallel_seed",
    "perplexity",
    "register_fabric_strategies",
    "register_model_parallel_strategy",
    "register_strategies",
    "restore_rng_state",
    "set_seed",
    "stream_seeds",
    "tensor_fingerprints",
]
