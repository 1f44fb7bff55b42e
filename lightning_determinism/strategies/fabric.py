"""The seeding contract under Lightning Fabric: deterministic strategies, worker seeding, RNG state in ``fabric.save``.

Fabric's ``seed_everything(s)`` seeds every rank with ``s``, and ``fabric.save`` holds no RNG state. With these
strategies (registered in Fabric's own registry under the Trainer's names: ``Fabric(strategy="ddp_deterministic")``)
the Trainer's contract holds in a hand-written loop, at these points of Fabric's life cycle:

1. ``fabric.launch()`` (the strategy's ``setup_environment``, once ranks and the process group exist): agree on the
   base seed, export it, set the backend flags, seed every rank with the *base* seed — models built next (before
   ``fabric.setup`` or inside ``fabric.init_module()``) are identical on every rank and to a one-process run.
   A ``fabric.seed_everything(s)`` called after ``launch()`` (Fabric's usual order) becomes the base seed;
2. the first ``fabric.setup(model, ...)`` (``setup_module``): seed every rank with ``base + rank`` (or the
   topology's streams) for training-time draws;
3. ``fabric.setup_dataloaders(...)`` (``process_dataloader``): the loader's workers, shuffle and (``per_sample``)
   samples are seeded as the Trainer's :class:`~lightning_determinism.WorkerSeedCallback` seeds them
   (:class:`~lightning_determinism.data.worker_seeding.LoaderSeeding`); loaders are numbered in the order they are set
   up, the first keyed like the Trainer's first training loader. A loader's epoch is the number of times it has
   been iterated, as Fabric counts it for ``DistributedSampler.set_epoch``
   (:mod:`~lightning_determinism.strategies.fabric_loaders`).

:class:`~lightning_determinism.strategies.fabric_state.FabricRNGState` (re-exported here) goes into the state of
``fabric.save``/``fabric.load``: every rank's RNG state and its loaders' generators, epochs and positions inside an
epoch (:mod:`~lightning_determinism.data.fabric_epoch`), verified on restore like
:class:`~lightning_determinism.RNGStateCheckpoint`, and in the invariant mode the step count (the strategy hands it its
invariant state in ``save_checkpoint`` / ``load_checkpoint``). World-size-invariant training in a hand-written loop:
:mod:`~lightning_determinism.strategies.fabric_invariant`.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from lightning.fabric.strategies import (
    STRATEGY_REGISTRY,
    DDPStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
)
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_determinism._compat.access import (
    device_mesh_of,
    model_parallel_sizes,
    replace_backward_sync_control,
    saves_distributed_checkpoint,
)
from lightning_determinism._compat.checks import require
from lightning_determinism._compat.features import FABRIC, MODEL_PARALLEL
from lightning_determinism.checkpoints.distributed_save import check_before_load, save_published
from lightning_determinism.checkpoints.io import AtomicCheckpointIOMixin
from lightning_determinism.data.worker_seeding import LoaderSeeding
from lightning_determinism.invariance.invariant import describe, keep_local_gradients
from lightning_determinism.invariance.tree import PairwiseAllReduce
from lightning_determinism.parallel.fsdp2_versions import average_over_gloo, refuse_uneven_strided_shards
from lightning_determinism.parallel.mesh import follow_mesh
from lightning_determinism.parallel.topology import Topology
from lightning_determinism.strategies.arguments import check_keywords, check_mesh_sizes, invariant_training
from lightning_determinism.strategies.fabric_invariant import FabricInvariantLoop
from lightning_determinism.strategies.fabric_loaders import prepare_loader
from lightning_determinism.strategies.fabric_record import FabricRecord
from lightning_determinism.strategies.fabric_run_end import end_run_with_launch
from lightning_determinism.strategies.fabric_state import FabricRNGState, warn_unsaved_positions
from lightning_determinism.strategies.invariant_clipping import clip_fabric_gradients_norm
from lightning_determinism.strategies.launchers import destroy_gloo_group_at_exit
from lightning_determinism.strategies.seeding_steps import SeedingProperties, SeedingSteps


class DeterministicFabricStrategyMixin(AtomicCheckpointIOMixin, SeedingProperties):
    """Adds the seeding contract to a Fabric strategy: ``class MyStrategy(DeterministicFabricStrategyMixin, ...)``.

    ``fabric.save`` writes atomically where the file lives
    (:class:`~lightning_determinism.checkpoints.io.AtomicCheckpointIO`) unless the strategy is given a ``CheckpointIO``
    of the user's own.

    Args:
        seed: base seed; ``None`` takes ``PL_GLOBAL_SEED`` (``seed_everything``) or has rank 0 draw one.
        debug_mode: backend flags, as in :func:`~lightning_determinism.configure_determinism`.
        topology: model-parallel degrees (a dict) or a :class:`~lightning_determinism.parallel.topology.Topology`.
        seed_workers: seed the workers, shuffle and generator of every loader passed to ``fabric.setup_dataloaders``.
        per_sample: also run each ``dataset[i]`` under RNG state derived from ``(base, epoch, i)``. ``None`` (the
            default): on in world-size-invariant training, where per-worker streams would follow the rank that loads
            a sample (``False`` with ``seed_workers`` is refused there), off otherwise.
        global_batch_size: ``B``, samples per optimizer step over all processes; with ``micro_batch_size`` it turns on
            world-size-invariant training in a loop that marks its micro-batches
            (:mod:`~lightning_determinism.strategies.fabric_invariant`; DDP and one device).
        micro_batch_size: ``m``, samples per forward/backward pass: the ``batch_size`` of the training loader (the
            first one passed to ``fabric.setup_dataloaders``). The loaders set up after it (evaluation) count every
            sample once: Fabric's padding ``DistributedSampler`` becomes an ``UnpaddedDistributedSampler``.
        invariant_threads: intra-op threads per process in the invariant mode (pinned; default 1).
        args: passed on to the strategy.
        kwargs: passed on to the strategy.

    Examples:
        >>> DeterministicFabricDDPStrategy(seed=3, start_method="popen").seed
        3
    """

    def __init__(
        self,
        *args: Any,
        seed: int | None = None,
        debug_mode: Any = "error",
        topology: Topology | dict[str, Any] | None = None,
        seed_workers: bool = True,
        per_sample: bool | None = None,
        global_batch_size: int | None = None,
        micro_batch_size: int | None = None,
        invariant_threads: int = 1,
        **kwargs: Any,
    ) -> None:
        require(FABRIC)
        check_keywords(type(self), DeterministicFabricStrategyMixin, kwargs)
        self._ldet_steps = SeedingSteps(seed, debug_mode, topology)
        invariant = invariant_training(global_batch_size, micro_batch_size, invariant_threads, self._ldet_steps,
                                       debug_mode, topology)  # fmt: skip
        self._ldet_invariant: FabricInvariantLoop | None = None
        if invariant is not None:
            if not isinstance(self, (DDPStrategy, SingleDeviceStrategy)):
                raise ValueError(
                    f"world-size-invariant training under Fabric runs on DeterministicFabricDDPStrategy and"
                    f" DeterministicFabricSingleDeviceStrategy, got {type(self).__name__}"
                )
            self._ldet_invariant = FabricInvariantLoop(invariant, marks_micro_batches=isinstance(self, DDPStrategy))
        for name, value in (("seed_workers", seed_workers), ("per_sample", per_sample)):
            if not isinstance(value, bool) and not (name == "per_sample" and value is None):
                raise TypeError(f"`{name}` must be a bool, got {value!r}")
        if per_sample is None:
            per_sample = invariant is not None
        elif invariant is not None and seed_workers and not per_sample:
            raise ValueError(
                "world-size-invariant training (`global_batch_size`, `micro_batch_size`) needs `per_sample=True` (the"
                " default there), got `per_sample=False`: per-worker seeds follow the rank that loads a sample, so the"
                " weights would change with the number of processes"
            )
        self.seed_workers, self.per_sample = seed_workers, per_sample
        self._ldet_seeding: LoaderSeeding | None = None
        self._ldet_model_ready = False
        self._ldet_record: FabricRecord | None = None  # set by log_determinism_record(fabric): fingerprints at saves
        self._ldet_backwards = 0
        self._ldet_loaders: list[weakref.ref[DataLoader]] = []
        super().__init__(*args, **kwargs)
        if self._ldet_invariant is not None and isinstance(self, DDPStrategy):
            replace_backward_sync_control(self, lambda _: self._ldet_invariant.control())  # type: ignore[union-attr]

    @property
    def micro_batches_per_rank(self) -> int:
        """``K = B / (m * W)``: the micro-batches of one optimizer step on this process (known after ``launch()``).

        Raises:
            RuntimeError: without ``global_batch_size`` and ``micro_batch_size``, or before ``fabric.launch()``.
        """
        loop = self._ldet_invariant
        if loop is None:
            raise RuntimeError(
                f"`micro_batches_per_rank` is the invariant mode's: pass `global_batch_size` and `micro_batch_size`"
                f" to {type(self).__name__}"
            )
        if not loop.launched:
            raise RuntimeError("`micro_batches_per_rank` is known once the ranks are: call `fabric.launch()` first")
        return loop.invariant.per_rank

    @override
    def _configure_launcher(self) -> None:  # type: ignore[misc]
        super()._configure_launcher()  # type: ignore[misc]
        # Fabric calls no teardown: a launched function's return ends the run, and the environment is put back.
        end_run_with_launch(self, self._ldet_steps)

    @override
    def setup_environment(self) -> None:  # type: ignore[misc]
        super().setup_environment()  # type: ignore[misc]
        destroy_gloo_group_at_exit()
        mesh = device_mesh_of(self)
        if mesh is not None:  # Fabric's ModelParallelStrategy: the mesh's rule (see mesh_seeding)
            follow_mesh(self._ldet_steps, mesh, self.global_rank, self.world_size)  # type: ignore[attr-defined]
        # Announced at the first fabric.setup(model): a seed_everything() after launch() may still change it.
        self._ldet_steps.ranks_known(self.global_rank, self.world_size, announce=False)  # type: ignore[attr-defined]
        loop = self._ldet_invariant
        if loop is not None:
            world_size: int = self.world_size  # type: ignore[attr-defined]
            loop.invariant.setup_environment(self.global_rank, world_size, self._ldet_steps.base_seed)  # type: ignore[attr-defined,arg-type]
            loop.launched = True
            invariant = loop.invariant
            rank_zero_info(describe(invariant.global_batch_size, invariant.micro_batch_size, world_size,
                                    invariant.threads))  # fmt: skip

    def _ldet_model_built(self) -> None:
        """The first ``fabric.setup(model)``: a late ``seed_everything`` becomes the base; then ``base + rank``."""
        if self._ldet_model_ready:
            return
        self._ldet_model_ready = True
        rank: int = self.global_rank  # type: ignore[attr-defined]
        self._ldet_steps.adopt_later_seed(rank, self.world_size)  # type: ignore[attr-defined]
        self._ldet_steps.model_built(rank)
        self._ldet_steps.announce(rank)
        if self._ldet_invariant is not None:
            self._ldet_invariant.invariant.set_base_seed(self._ldet_steps.base_seed)  # type: ignore[arg-type]

    @override
    def setup_module_and_optimizers(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
        result = super().setup_module_and_optimizers(*args, **kwargs)  # type: ignore[misc]
        average_over_gloo(result[0])  # torch 2.8's FSDP2 sums over gloo
        refuse_uneven_strided_shards(result[0])  # torch < 2.10 gathers them wrongly
        self._ldet_model_built()
        return result

    @override
    def setup_module(self, module: torch.nn.Module) -> Any:  # type: ignore[misc]
        result = super().setup_module(module)  # type: ignore[misc]
        average_over_gloo(result)  # torch 2.8's FSDP2 sums over gloo
        refuse_uneven_strided_shards(result)  # torch < 2.10 gathers them wrongly
        self._ldet_model_built()
        if self._ldet_invariant is not None:
            self._ldet_invariant.module_set_up(module, result)
        return result

    @override
    def backward(self, tensor: torch.Tensor, module: Any, *args: Any, **kwargs: Any) -> None:  # type: ignore[misc]
        loop = self._ldet_invariant
        if loop is not None:
            loop.before_backward()
        self._ldet_backwards += 1  # the loop trains on what its loaders gave it (see data.fabric_epoch)
        super().backward(tensor, module, *args, **kwargs)  # type: ignore[misc]
        if loop is not None:
            loop.after_backward()

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
        loop = self._ldet_invariant
        if loop is not None:
            loop.before_optimizer_step()
        result = super().optimizer_step(optimizer, **kwargs)  # type: ignore[misc]
        if loop is not None:
            loop.after_optimizer_step()
        return result

    @override
    def clip_gradients_norm(self, module: Any, optimizer: Any, max_norm: float, norm_type: float = 2.0,  # type: ignore[misc]
                            error_if_nonfinite: bool = True) -> torch.Tensor:  # fmt: skip
        if self._ldet_invariant is None and device_mesh_of(self) is None:
            return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)  # type: ignore[misc,no-any-return]
        # The total norm summed exactly: the same bits on every world size (see strategies.invariant_clipping).
        return clip_fabric_gradients_norm(self.precision, optimizer, max_norm, norm_type, error_if_nonfinite)  # type: ignore[attr-defined]

    def _ldet_hand_invariant(self, state: Any) -> None:
        """Give every ``FabricRNGState`` in ``state`` this strategy's invariant mode, which it saves or restores."""
        if isinstance(state, dict):
            for obj in state.values():
                if isinstance(obj, FabricRNGState):
                    obj.invariant = self._ldet_invariant

    @override
    def save_checkpoint(self, path: Any, state: dict[str, Any], *args: Any, **kwargs: Any) -> None:  # type: ignore[misc]
        self._ldet_hand_invariant(state)
        warn_unsaved_positions(state, [loader for ref in self._ldet_loaders if (loader := ref()) is not None])
        if self._ldet_record is not None:  # the model's fingerprint into the file and the loggers (every rank)
            self._ldet_record.on_save(state)
        super().save_checkpoint(path, state, *args, **kwargs)  # type: ignore[misc]

    @override
    def load_checkpoint(self, path: Any, state: Any = None, *args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
        self._ldet_hand_invariant(state)
        return super().load_checkpoint(path, state, *args, **kwargs)  # type: ignore[misc]

    @override
    def process_dataloader(self, dataloader: DataLoader) -> DataLoader:  # type: ignore[misc]
        # Ordered or unpadded in the invariant mode, seeded, resumable mid-epoch (see strategies.fabric_loaders).
        return prepare_loader(self, super().process_dataloader(dataloader))  # type: ignore[misc]

    @override
    def teardown(self) -> None:  # type: ignore[misc]
        super().teardown()  # type: ignore[misc]
        self._ldet_steps.restore_env()
        if self._ldet_invariant is not None:
            self._ldet_invariant.teardown()


class DeterministicFabricDDPStrategy(DeterministicFabricStrategyMixin, DDPStrategy):
    """Fabric's ``DDPStrategy`` with the seeding contract.

    Registered in Fabric as ``ddp_deterministic`` (popen), ``ddp_spawn_deterministic``, ``ddp_fork_deterministic``
    and ``ddp_notebook_deterministic``. On more than two processes the gradient buckets are reduced over a fixed tree
    of two-process all-reduces (:class:`~lightning_determinism.invariance.tree.PairwiseAllReduce`): the sums do not
    depend on DDP's bucket layout, which a module set up again (a resumed loop) rebuilds. In the invariant mode
    (``global_batch_size``, ``micro_batch_size``) DDP's own sync never runs: the gradient tree sums instead.
    """

    @override
    def setup_module(self, module: torch.nn.Module) -> DistributedDataParallel:
        ddp = super().setup_module(module)
        if self._ldet_invariant is not None:  # the tree sums (see fabric_invariant); DDP copies nothing into buckets
            ddp.register_comm_hook(None, keep_local_gradients)  # type: ignore[arg-type]
            ddp.require_backward_grad_sync = False
        elif self.world_size > 2:
            ddp.register_comm_hook(None, PairwiseAllReduce(self.world_size, self.global_rank).reduce)  # type: ignore[arg-type]
        return ddp


class DeterministicFabricFSDPStrategy(DeterministicFabricStrategyMixin, FSDPStrategy):
    """Fabric's ``FSDPStrategy`` with the seeding contract; registered as ``fsdp_deterministic`` (CUDA only)."""


class DeterministicFabricModelParallelStrategy(DeterministicFabricStrategyMixin, ModelParallelStrategy):
    """Fabric's ``ModelParallelStrategy`` (FSDP2 + tensor parallel) seeded by its device mesh, as the Trainer's.

    Not registered by name: Fabric's strategy takes the user's ``parallelize_fn(module, device_mesh)`` first, as
    ``DeterministicFabricModelParallelStrategy(parallelize_fn, data_parallel_size=..., tensor_parallel_size=...,
    seed=...)``. The rule: :class:`~lightning_determinism.DeterministicModelParallelStrategy`.

    ``fabric.load`` of a distributed checkpoint restores stateful objects (``FabricRNGState``) as Fabric's other
    strategies do: Fabric's ``ModelParallelStrategy`` put the saved dict in their place in ``state`` instead, so the
    RNG streams were silently not restored and a resumed loop drew other numbers.

    Mesh mistakes are refused as the Trainer's strategy refuses them, in one line before launch (see
    :func:`~lightning_determinism.strategies.arguments.check_mesh_sizes`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        require(MODEL_PARALLEL)
        super().__init__(*args, **kwargs)
        check_mesh_sizes(model_parallel_sizes(self), 1, None, self._ldet_invariant is not None)

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        devices = len(self.parallel_devices) if self.parallel_devices else 1
        world_size = int(self.num_nodes) * devices
        check_mesh_sizes(model_parallel_sizes(self), int(self.num_nodes), world_size, self._ldet_invariant is not None)

    @override
    def save_checkpoint(self, path: Any, state: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        """Fabric's save; a distributed checkpoint directory is written hidden and published whole, as the Trainer's."""
        if not saves_distributed_checkpoint(self) or args or any(v is not None for v in kwargs.values()):
            super().save_checkpoint(path, state, *args, **kwargs)
            return
        save_published(self, path, lambda hidden: super(DeterministicFabricModelParallelStrategy, self)
                       .save_checkpoint(hidden, state), None)  # fmt: skip

    @override
    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]  # weights_only: Lightning >= 2.6 only
        check_before_load(path, self.global_rank)  # a torn or mixed directory: one line, before it is used
        stateful = {}
        if isinstance(state, dict):
            stateful = {key: obj for key, obj in state.items()
                        if not isinstance(obj, (torch.nn.Module, torch.optim.Optimizer))
                        and callable(getattr(obj, "load_state_dict", None))}  # fmt: skip
        remainder: dict[str, Any] = super().load_checkpoint(path, state, strict, **kwargs)
        for key, obj in stateful.items():
            saved = state[key]
            if saved is not obj:  # Fabric replaced the object by what was saved for it
                obj.load_state_dict(saved)
                state[key] = obj
        return remainder


class DeterministicFabricSingleDeviceStrategy(DeterministicFabricStrategyMixin, SingleDeviceStrategy):
    """Fabric's ``SingleDeviceStrategy`` with the seeding contract; ``single_device_deterministic`` (the CPU)."""


_REGISTRATIONS: tuple[tuple[str, type, dict[str, Any]], ...] = (
    ("ddp_deterministic", DeterministicFabricDDPStrategy, {"start_method": "popen"}),
    ("ddp_spawn_deterministic", DeterministicFabricDDPStrategy, {"start_method": "spawn"}),
    ("ddp_fork_deterministic", DeterministicFabricDDPStrategy, {"start_method": "fork"}),
    ("ddp_notebook_deterministic", DeterministicFabricDDPStrategy, {"start_method": "fork"}),
    ("fsdp_deterministic", DeterministicFabricFSDPStrategy, {}),
    ("single_device_deterministic", DeterministicFabricSingleDeviceStrategy, {"device": "cpu"}),
)


def register_fabric_strategies() -> list[str]:
    """Register the deterministic strategies in Fabric's ``STRATEGY_REGISTRY``; safe to call again.

    Examples:
        >>> "ddp_deterministic" in register_fabric_strategies()
        True
    """
    for name, cls, init_params in _REGISTRATIONS:
        description = f"{cls.__name__} {init_params or ''}".strip()
        STRATEGY_REGISTRY.register(name, cls, description=description, override=True, **init_params)
    return [name for name, _, _ in _REGISTRATIONS]


__all__ = [
    "DeterministicFabricDDPStrategy",
    "DeterministicFabricFSDPStrategy",
    "DeterministicFabricModelParallelStrategy",
    "DeterministicFabricSingleDeviceStrategy",
    "DeterministicFabricStrategyMixin",
    "FabricRNGState",
    "register_fabric_strategies",
]
