"""Deterministic Lightning strategies: rank-offset seeding and deterministic backends at the right moment.

Lightning's ``DDPStrategy.setup_distributed`` calls ``reset_seed()``, which reseeds every rank with the same
``PL_GLOBAL_SEED``; anything seeded before ``setup_environment`` is undone there. The mixin therefore acts in
two steps, both after Lightning's own:

1. at the end of ``setup_environment`` (ranks and the process group exist): agree on the base seed, export it
   as ``PL_GLOBAL_SEED`` (so the injected ``DistributedSampler`` shuffles alike on every rank), set the backend
   flags and seed every rank with the *base* seed, so ``setup``/``configure_model`` build identical weights;
2. at the end of ``setup`` (the model is wrapped and synchronised): seed every rank with ``base + global_rank``,
   so dropout masks and other training-time draws differ between ranks, reproducibly.

Validation and test loaders also get a sampler that counts every sample once (no padding with repeats), so a
distributed metric over an evaluation set equals the single-process value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy
from lightning.pytorch.trainer.states import RunningStage
from typing_extensions import override

from lightning_determinism._compat.access import (
    accelerator_connector,
    ddp_comm_hook,
    device_mesh_of,
    module_trainer,
    swap_launcher,
    trainer_torch_flags,
)
from lightning_determinism._compat.checks import require, set_sampler_epoch
from lightning_determinism._compat.features import INVARIANT_FSDP2, TRAINER
from lightning_determinism.checkpoints.io import AtomicCheckpointIOMixin
from lightning_determinism.data.positions import next_train_epoch
from lightning_determinism.data.resumable import make_fork_safe, make_resumable
from lightning_determinism.data.samplers import PaddingWarningFilter, UnevenEvalGuard, trainer_of, unpad_eval_dataloader
from lightning_determinism.invariance.batch_invariant import batch_invariant as batch_invariant_mode
from lightning_determinism.invariance.invariant import InvariantTraining, describe, keep_local_gradients
from lightning_determinism.invariance.tree import PairwiseAllReduce
from lightning_determinism.parallel.fsdp2_versions import average_over_gloo, refuse_uneven_strided_shards
from lightning_determinism.parallel.mesh import follow_mesh
from lightning_determinism.parallel.topology import Topology
from lightning_determinism.seeding.isolation import EvaluationIsolation
from lightning_determinism.strategies.arguments import (
    check_keywords,
    check_planned_world,
    follow_trainer_flags,
    invariant_training,
    refuse_per_worker_seeds,
)
from lightning_determinism.strategies.invariant_clipping import clip_exactly
from lightning_determinism.strategies.launchers import (
    adopt_parent_from_env,
    destroy_gloo_group_at_exit,
    replace_launcher,
)
from lightning_determinism.strategies.resume_path import install as resolve_ckpt_path_once
from lightning_determinism.strategies.seeding_steps import DEFAULT_DEBUG_MODE, SeedingProperties, SeedingSteps


class DeterministicStrategyMixin(AtomicCheckpointIOMixin, SeedingProperties):
    """Adds rank-offset seeding and deterministic backends to a Lightning strategy.

    Mix it in *before* the strategy class: ``class MyStrategy(DeterministicStrategyMixin, DDPStrategy)``. Checkpoints
    are written atomically where they live (:class:`~lightning_determinism.checkpoints.io.AtomicCheckpointIO`) unless
    the strategy is given a ``CheckpointIO`` of the user's own.

    Args:
        seed: base seed. ``None`` takes ``PL_GLOBAL_SEED`` (set by ``seed_everything``) when present, else rank 0
            draws one from OS entropy; either way rank 0's choice is broadcast so all ranks agree.
        debug_mode: backend flags, as in :func:`~lightning_determinism.configure_determinism`; ``None`` leaves
            every flag as it is.
        topology: for model parallelism, the degrees as a dict (``{"mp_degree": 2, ...}``, the keyword arguments of
            :class:`~lightning_determinism.parallel.topology.Topology` but rank and world size) or a ``Topology``. With
            one, training-time streams come from :func:`~lightning_determinism.parallel.topology.model_parallel_seed`
            (identical across tensor-parallel peers, distinct across data-parallel replicas and pipeline stages) instead
            of ``base + global_rank``, and the tracker's ``"model-parallel-rng"`` stream is set up.
        global_batch_size: ``B``, samples per optimizer step over all processes; with ``micro_batch_size`` it turns on
            world-size-invariant training (the same bits on 1, 2, 4, ... processes; see docs/invariance.md).
        micro_batch_size: ``m``, samples per forward/backward pass: the training loader's ``batch_size``.
        invariant_threads: intra-op threads per process in the invariant mode (pinned; default 1).
        batch_invariant: run every evaluation pass (validation, sanity check, test, predict) under
            :func:`~lightning_determinism.batch_invariant`: a sample's outputs, and so the exact metrics, get the same
            bits whatever its batch, the eval batch size and the number of processes (docs/batch-invariance.md).
        log_record: log the determinism record (seeds, backends, versions, the model's fingerprints) through the
            trainer's loggers with a :class:`~lightning_determinism.DeterminismRecord` (added unless the trainer has
            one); ``False`` logs none of it (docs/record.md).
        args: passed on to the strategy.
        kwargs: passed on to the strategy.

    Raises:
        TypeError: if ``seed`` is not an integer.
        ValueError: if ``seed`` is outside ``[0, 2**32 - 1]``, ``debug_mode`` is not an accepted value, or the
            invariant mode's arguments do not fit (see
            :class:`~lightning_determinism.invariance.invariant.InvariantTraining`).

    Examples:
        >>> strategy = DeterministicDDPStrategy(seed=42, debug_mode="warn")
        >>> strategy.seed, strategy.debug_mode
        (42, 'warn')
    """

    _ldet_one_checkpoint = True  # every rank resumes from the checkpoint rank 0 resolved (strategies.resume_path)

    def __init__(
        self,
        *args: Any,
        seed: int | None = None,
        debug_mode: Any = DEFAULT_DEBUG_MODE,
        topology: Topology | dict[str, Any] | None = None,
        global_batch_size: int | None = None,
        micro_batch_size: int | None = None,
        invariant_threads: int = 1,
        batch_invariant: bool = False,
        log_record: bool = True,
        **kwargs: Any,
    ) -> None:
        require(TRAINER)
        check_keywords(type(self), DeterministicStrategyMixin, kwargs)
        for name, flag in (("batch_invariant", batch_invariant), ("log_record", log_record)):
            if not isinstance(flag, bool):
                raise TypeError(f"`{name}` must be a bool, got {flag!r}")
        self.log_record = log_record
        self.batch_invariant = batch_invariant
        self._ldet_steps = SeedingSteps(seed, debug_mode, topology)
        self.invariant: InvariantTraining | None = invariant_training(
            global_batch_size, micro_batch_size, invariant_threads, self._ldet_steps, debug_mode, topology
        )
        self._ldet_eval_guard = UnevenEvalGuard()
        self._ldet_padding_warning = PaddingWarningFilter()  # false under this strategy: evaluation is unpadded
        # Evaluation never moves training's streams; with batch_invariant, a sample's bits never depend on its batch.
        self._ldet_isolation = EvaluationIsolation(
            self._ldet_steps, around=batch_invariant_mode if batch_invariant else None
        )
        self._ldet_restore_clipping: Callable[[], None] | None = None  # not a lambda: spawn pickles the strategy
        resolve_ckpt_path_once()  # ckpt_path="last" resolved by rank 0, the same checkpoint on every rank
        super().__init__(*args, **kwargs)

    # The base methods come from the strategy the mixin is combined with, hence the ignores for mypy.
    @override
    def _configure_launcher(self) -> None:  # type: ignore[misc]
        super()._configure_launcher()  # type: ignore[misc]
        swap_launcher(self, lambda launcher: replace_launcher(launcher, self))
        # In the main process, before any rank exists: refused once, not per rank.
        said = follow_trainer_flags(self._ldet_steps, self.invariant, trainer_torch_flags(), type(self).__name__)
        if said is not None:
            rank_zero_info(said)
        check_planned_world(self._ldet_steps, self._ldet_planned_world_size())
        if self.invariant is not None:
            self.invariant.check_world_size(self._ldet_planned_world_size())

    def _ldet_planned_world_size(self) -> int:
        devices = getattr(self, "parallel_devices", None)
        return int(getattr(self, "num_nodes", 1)) * (len(devices) if devices else 1)

    def check_before_launch(self, trainer: pl.Trainer, module: Any) -> None:
        """The invariant mode's checks that the main process can make before the launcher starts the ranks.

        Called by the package's launchers before they start the ranks; a refusal is then one error in one process
        instead of a traceback from every rank. ``setup`` checks again inside each rank (torchrun, single device).
        """
        if self.invariant is not None and trainer.state.fn == "fit" and module is not None:
            world_size = self._ldet_planned_world_size()
            if world_size > 1 and isinstance(self, ModelParallelStrategy):  # torch 2.8: said once, not per rank
                require(INVARIANT_FSDP2)
            self.invariant.check_before_launch(world_size, trainer.accumulate_grad_batches, module)
            refuse_per_worker_seeds(trainer)

    @override
    def setup_environment(self) -> None:  # type: ignore[misc]
        adopt_parent_from_env()  # a popen child script: die with the rank-0 process that started it
        super().setup_environment()  # type: ignore[misc]
        destroy_gloo_group_at_exit()
        self._add_callbacks()
        self._ldet_padding_warning.install()
        rank: int = self.global_rank  # type: ignore[attr-defined]
        world_size: int = self.world_size  # type: ignore[attr-defined]
        invariant = self.invariant

        def describe_invariant() -> None:
            if invariant is not None:
                invariant.setup_environment(rank, world_size, self._ldet_steps.base_seed)  # type: ignore[arg-type]
                rank_zero_info(describe(invariant.global_batch_size, invariant.micro_batch_size, world_size,
                                        invariant.threads))  # fmt: skip

        self._ldet_follow_mesh(rank, world_size)
        self._ldet_steps.ranks_known(rank, world_size, before_log=describe_invariant)

    def _ldet_follow_mesh(self, rank: int, world_size: int) -> None:
        """On a strategy with a device mesh (``ModelParallelStrategy``): the mesh's seeding rule, equal threads.

        Without it, ``base + rank`` would give tensor-parallel peers other dropout masks on replicated activations
        and their replicated parameters would drift apart (see :mod:`~lightning_determinism.parallel.mesh`).
        """
        mesh = device_mesh_of(self)
        if mesh is not None:
            follow_mesh(self._ldet_steps, mesh, rank, world_size)
            if self.invariant is not None and int(mesh.shape[-1]) > 1:
                raise ValueError(
                    f"[rank: {rank}] world-size-invariant training (`global_batch_size`, `micro_batch_size`) runs on"
                    " FSDP2 over data-parallel ranks: it needs `tensor_parallel_size=1`, got"
                    f" {int(mesh.shape[-1])} (a tensor-parallel rank's micro-batches are not its own)"
                )

    def _add_callbacks(self) -> None:
        """Put an RNGStateCheckpoint, a ResumeReplay (and, with ``log_record``, a DeterminismRecord) in the callbacks.

        A callback of the same class the user gave is kept instead (after the RNG state's restore: the record's
        digests are those of the restored streams).
        """
        from lightning_determinism.callbacks._resume_replay import ResumeReplay
        from lightning_determinism.callbacks.determinism_record import DeterminismRecord
        from lightning_determinism.callbacks.preemption import preemption_needed
        from lightning_determinism.callbacks.rng_checkpoint import RNGStateCheckpoint

        trainer = module_trainer(getattr(self, "lightning_module", None))
        if trainer is None:
            return
        wanted: tuple[type, ...] = (RNGStateCheckpoint, DeterminismRecord) if self.log_record else (RNGStateCheckpoint,)
        wanted += (ResumeReplay,)  # what Lightning's restart of a resumed fit skips, replayed
        for cls in wanted:
            if not any(isinstance(cb, cls) for cb in trainer.callbacks):
                trainer.callbacks.append(cls())
        preemption = preemption_needed(trainer) if trainer.state.fn == "fit" else None
        if preemption is not None:  # Lightning's own handler would save mid-step (SLURM's SIGUSR1)
            trainer.callbacks.append(preemption)

    @override
    def setup(self, trainer: pl.Trainer) -> None:  # type: ignore[misc]
        if self._ldet_steps.base_seed is None:
            raise RuntimeError(
                f"{type(self).__name__}.setup() ran before setup_environment(): the base seed is unknown. Let the"
                " Trainer call both, in that order."
            )
        if self.invariant is not None:
            self.invariant.setup(trainer)  # before configure_optimizers reads `estimated_stepping_batches`
            self.invariant.check_module(trainer.lightning_module)
            if trainer.state.fn == "fit":
                refuse_per_worker_seeds(trainer)
        super().setup(trainer)  # type: ignore[misc]
        # The total norm of clipping summed exactly: the same bits on any sharding. Under a device mesh always: torch's
        # norm of tensor-parallel and FSDP2 gradients on two meshes fails outright, and sums shards in their order.
        if self.invariant is not None or device_mesh_of(self) is not None:
            self._ldet_restore_clipping = clip_exactly(self.precision_plugin)  # type: ignore[attr-defined]
        if device_mesh_of(self) is not None:
            average_over_gloo(trainer.lightning_module)  # torch 2.8's FSDP2 sums over gloo
            refuse_uneven_strided_shards(trainer.lightning_module)  # torch < 2.10 gathers them wrongly
        if self.invariant is not None and device_mesh_of(self) is not None:
            self._ldet_invariant_fsdp(trainer)
        self._ldet_steps.model_built(self.global_rank)  # type: ignore[attr-defined]
        self._ldet_isolation.attach(trainer)

    def _ldet_invariant_fsdp(self, trainer: pl.Trainer) -> None:
        """Under ``ModelParallelStrategy``: the invariant mode sums inside FSDP2's reduce-scatter (``invariance.fsdp``).

        Raises:
            ValueError: on several processes with no ``fully_shard``-ed module (nothing would reduce the gradients).
        """
        invariant = self.invariant
        assert invariant is not None
        if invariant.reduce_in_fsdp(trainer.lightning_module) == 0 and invariant.world_size > 1:
            raise ValueError(
                "world-size-invariant training under ModelParallelStrategy sums the gradients inside FSDP2: apply"
                " `fully_shard` to the model in `configure_model` (on the `data_parallel` mesh); nothing reduces the"
                f" gradients of {invariant.world_size} processes otherwise"
            )

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
        if self.invariant is not None:  # randomness follows the micro-batch, not the rank
            self.invariant.before_micro_batch(self.lightning_module.trainer.global_step)  # type: ignore[attr-defined]
        return super().training_step(*args, **kwargs)  # type: ignore[misc]

    @override
    def backward(self, closure_loss: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
        result = super().backward(closure_loss, optimizer, *args, **kwargs)  # type: ignore[misc]
        if self.invariant is not None:
            module = self.lightning_module  # type: ignore[attr-defined]
            parameters = [p for p in module.parameters() if p.requires_grad]
            self.invariant.after_backward(parameters, module.trainer.global_step)
        return result

    @override
    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
        # Lightning's `self.log(..., sync_dist=True)` reduces through here.
        module = getattr(self, "lightning_module", None)
        self._ldet_eval_guard.check("self.log(..., on_step=True, sync_dist=True)", trainer_of(module))
        return super().reduce(tensor, *args, **kwargs)  # type: ignore[misc]

    @override
    def teardown(self) -> None:  # type: ignore[misc]
        super().teardown()  # type: ignore[misc]
        if self._ldet_restore_clipping is not None:
            self._ldet_restore_clipping()
            self._ldet_restore_clipping = None
        self._ldet_steps.restore_env()
        self._ldet_padding_warning.remove()
        self._ldet_isolation.detach()

    @override
    def process_dataloader(self, dataloader: object) -> object:  # type: ignore[misc]
        dataloader = super().process_dataloader(dataloader)  # type: ignore[misc]
        trainer = module_trainer(self.lightning_module)  # type: ignore[attr-defined]
        if trainer is None:
            return dataloader
        stage = trainer.state.stage
        if stage == RunningStage.TRAINING:
            if self.invariant is not None:
                dataloader = self.invariant.process_train_loader(dataloader, self.global_rank, self.world_size)  # type: ignore[attr-defined]
            # Lightning creates the first iterator of a run (and, with workers, draws its first indices) before it
            # calls `sampler.set_epoch`; on a resumed run the sampler would replay epoch 0's order.
            set_sampler_epoch(dataloader, next_train_epoch(trainer))
            # Mid-epoch resume at the index level (see lightning_determinism.data.resumable), with the user's own
            # samplers too (`use_distributed_sampler=False`: a stream that shards itself), which stay as they are.
            return make_resumable(dataloader, trainer)
        if stage not in (RunningStage.VALIDATING, RunningStage.TESTING, RunningStage.SANITY_CHECKING):
            return dataloader
        if accelerator_connector(trainer).use_distributed_sampler:
            # Evaluation needs no equal batch counts: count every sample once instead of padding with repeats.
            dataloader = unpad_eval_dataloader(dataloader)
            self._ldet_eval_guard.watch(dataloader, self.lightning_module)  # type: ignore[attr-defined]
        return make_fork_safe(dataloader, trainer)


class DeterministicDDPStrategy(DeterministicStrategyMixin, DDPStrategy):
    """Lightning's :class:`~lightning.pytorch.strategies.DDPStrategy` with deterministic seeding and backends.

    Registered as ``ddp_deterministic`` (popen), ``ddp_spawn_deterministic``, ``ddp_fork_deterministic`` and
    ``ddp_notebook_deterministic``. All ``DDPStrategy`` arguments are accepted. Ranks exit cleanly under gloo, die
    with the process that started them, and forked ranks do not hang in OpenMP (see
    :mod:`~lightning_determinism.strategies.launchers`).

    Examples:
        >>> DeterministicDDPStrategy(seed=1, start_method="fork").base_seed is None  # known once set up
        True
    """

    @override
    def _register_ddp_hooks(self) -> None:
        if self.invariant is None:
            super()._register_ddp_hooks()
            if self.world_size > 2 and ddp_comm_hook(self) is None:
                # Sums that do not depend on DDP's bucket layout, which a resumed run rebuilds (see the hook).
                hook = PairwiseAllReduce(self.world_size, self.global_rank)
                self.model.register_comm_hook(None, hook.reduce)  # type: ignore[union-attr,operator]
            return
        # The invariant mode sums gradients itself, over a fixed tree: DDP's float all-reduce must not run. Its
        # reducer is switched off for every micro-batch (as `no_sync` does for all but the last one): it would copy
        # every gradient into its buckets and back for nothing. The hook stays as a guard should anything turn the
        # reducer on again.
        self.model.register_comm_hook(None, keep_local_gradients)  # type: ignore[union-attr,operator]
        self.model.require_backward_grad_sync = False  # type: ignore[union-attr]


class DeterministicFSDPStrategy(DeterministicStrategyMixin, FSDPStrategy):
    """Lightning's :class:`~lightning.pytorch.strategies.FSDPStrategy` with deterministic seeding and backends.

    Registered as ``fsdp_deterministic``. Lightning's FSDP (FSDP1) runs on CUDA only: a CPU accelerator is refused
    when the Trainer is built. FSDP2 runs on CPU under Lightning's ``ModelParallelStrategy``.

    Examples:
        >>> DeterministicFSDPStrategy(seed=3).seed
        3
    """

    @override
    def _configure_launcher(self) -> None:
        devices = self.parallel_devices or []
        if any(device.type == "cpu" for device in devices):
            raise ValueError(
                f"`strategy=fsdp_deterministic` (Lightning's FSDPStrategy, FSDP1) needs CUDA devices, got"
                f" {len(devices)} CPU device(s); on a CPU, Lightning's ModelParallelStrategy runs FSDP2"
            )
        super()._configure_launcher()


class DeterministicSingleDeviceStrategy(DeterministicStrategyMixin, SingleDeviceStrategy):
    """Lightning's :class:`~lightning.pytorch.strategies.SingleDeviceStrategy` with the same seeding contract.

    Lets the same user code run on one device: rank 0's seed is ``base + 0``. Registered as
    ``single_device_deterministic`` (on the CPU; pass ``device="cuda:0"`` for a GPU).

    Examples:
        >>> DeterministicSingleDeviceStrategy(seed=5, device="cpu").root_device
        device(type='cpu')
    """


__all__ = [
    "DeterministicDDPStrategy",
    "DeterministicFSDPStrategy",
    "DeterministicSingleDeviceStrategy",
    "DeterministicStrategyMixin",
]
