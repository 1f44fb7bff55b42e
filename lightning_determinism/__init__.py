"""Reproducible PyTorch Lightning training and evaluation across ranks, nodes, restarts and workers.

Importing the package registers the deterministic strategies in Lightning's ``StrategyRegistry`` and in Fabric's
(``ddp_deterministic``, ``ddp_spawn_deterministic``, ``ddp_fork_deterministic``, ``fsdp_deterministic``, ...).
Every public name the documentation uses can be imported from here.
"""

from lightning_determinism import _moved
from lightning_determinism.__about__ import __version__
from lightning_determinism.callbacks import (
    DeterminismRecord,
    NumericalBaseline,
    PreemptionCheckpoint,
    ReplicaGuard,
    RNGStateCheckpoint,
    SampleRecord,
    WorkerSeedCallback,
)
from lightning_determinism.checkpoints.file import DamagedCheckpointError
from lightning_determinism.checkpoints.io import AtomicCheckpointIO
from lightning_determinism.data.samplers import UnpaddedDistributedSampler
from lightning_determinism.divergence.baseline_file import BaselineFileError, compare_baselines, load_baseline
from lightning_determinism.divergence.baseline_recorder import BaselineMismatch, BaselineRecorder
from lightning_determinism.divergence.diagnosis import (
    DivergenceProbe,
    ProbeFileError,
    ProbeRecorder,
    bisect_checkpoints,
    diagnose,
    diagnose_checkpoints,
    load_probe,
)
from lightning_determinism.divergence.fingerprint import fingerprint, tensor_fingerprints
from lightning_determinism.errors import DeterminismWarning, IncompatibleVersionError
from lightning_determinism.invariance.attention import invariant_attention
from lightning_determinism.invariance.batch_invariant import batch_invariant, batch_invariant_enabled
from lightning_determinism.metrics import DistributedMean, DistributedPerplexity, perplexity
from lightning_determinism.parallel.topology import GroupInfo, Topology, model_parallel_seed, stream_seeds
from lightning_determinism.seeding.backends import configure_determinism, determinism_report
from lightning_determinism.seeding.isolation import evaluation_streams
from lightning_determinism.seeding.rng import (
    RNGStatesTracker,
    capture_rng_state,
    generator,
    get_rng_tracker,
    restore_rng_state,
)
from lightning_determinism.seeding.sample_streams import SampleStreams, sample_seed, sample_streams
from lightning_determinism.seeding.seeds import derive_seed, set_seed
from lightning_determinism.strategies.fabric import (
    DeterministicFabricDDPStrategy,
    DeterministicFabricFSDPStrategy,
    DeterministicFabricModelParallelStrategy,
    DeterministicFabricSingleDeviceStrategy,
    DeterministicFabricStrategyMixin,
    FabricRNGState,
    register_fabric_strategies,
)
from lightning_determinism.strategies.fabric_record import log_determinism_record, log_fingerprint
from lightning_determinism.strategies.model_parallel import (
    DeterministicModelParallelStrategy,
    register_model_parallel_strategy,
)
from lightning_determinism.strategies.registry import register_strategies
from lightning_determinism.strategies.trainer import (
    DeterministicDDPStrategy,
    DeterministicFSDPStrategy,
    DeterministicSingleDeviceStrategy,
    DeterministicStrategyMixin,
)

register_strategies()
register_model_parallel_strategy()
register_fabric_strategies()
_moved.install()  # the flat layout's module paths, for one release (see _moved)

__all__ = [
    "AtomicCheckpointIO",
    "BaselineFileError",
    "BaselineMismatch",
    "BaselineRecorder",
    "DamagedCheckpointError",
    "DeterminismRecord",
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
    "SampleRecord",
    "SampleStreams",
    "Topology",
    "UnpaddedDistributedSampler",
    "WorkerSeedCallback",
    "__version__",
    "batch_invariant",
    "batch_invariant_enabled",
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
    "invariant_attention",
    "load_baseline",
    "load_probe",
    "log_determinism_record",
    "log_fingerprint",
    "model_parallel_seed",
    "perplexity",
    "register_fabric_strategies",
    "register_model_parallel_strategy",
    "register_strategies",
    "restore_rng_state",
    "sample_seed",
    "sample_streams",
    "set_seed",
    "stream_seeds",
    "tensor_fingerprints",
]
