"""``model_parallel_deterministic``: Lightning's ``ModelParallelStrategy`` (FSDP2 + tensor parallel) made reproducible.

Lightning's ``ModelParallelStrategy`` builds a ``("data_parallel", "tensor_parallel")`` device mesh, the model is
parallelised in ``configure_model`` (``parallelize_module``, ``fully_shard``) and it runs on CPU with gloo as on
GPUs. Seeding every rank alike (Lightning's ``seed_everything``) gives every data-parallel rank the same dropout
masks; seeding ``base + rank`` gives tensor-parallel peers other masks on replicated activations, and the replicated
parameters drift apart. This strategy seeds by the mesh (:mod:`~lightning_determinism.parallel.mesh`): the model is
built under the base seed on every rank; the default streams are shared by tensor-parallel peers and distinct across
data-parallel ranks; ``get_rng_tracker().fork()`` gives every (data-parallel, tensor-parallel) coordinate its own
stream for draws on a shard; every rank computes with the same number of intra-op threads. Checkpoints (Lightning's
distributed checkpoint directories) carry every rank's RNG state and data position, restored on resume; they are
written under a hidden name and published whole (:mod:`~lightning_determinism.checkpoints.publish`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from typing_extensions import override

from lightning_determinism._compat.access import model_parallel_sizes, module_trainer, saves_distributed_checkpoint
from lightning_determinism._compat.checks import MultiProcessingLauncher, require
from lightning_determinism._compat.features import MODEL_PARALLEL
from lightning_determinism.callbacks.replica_guard import ReplicaGuard
from lightning_determinism.checkpoints.distributed import load_distributed_checkpoint
from lightning_determinism.checkpoints.distributed_save import check_before_load, save_published
from lightning_determinism.strategies.arguments import check_mesh_sizes
from lightning_determinism.strategies.launchers import replace_launcher
from lightning_determinism.strategies.trainer import DeterministicStrategyMixin

START_METHODS = ("popen", "fork", "spawn")


class DeterministicModelParallelStrategy(DeterministicStrategyMixin, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` with seeding by the device mesh and deterministic backends.

    Registered as ``model_parallel_deterministic``. Takes every argument of ``ModelParallelStrategy``
    (``data_parallel_size``, ``tensor_parallel_size``, ``save_distributed_checkpoint``, ...) plus ``seed`` and
    ``debug_mode`` (see :class:`~lightning_determinism.DeterministicStrategyMixin`), and ``start_method``.

    Args:
        args: passed on to ``ModelParallelStrategy``.
        start_method: ``"popen"`` (Lightning's own launcher: the script runs again in each rank, the choice for
            scripts), ``"fork"`` (notebooks, tests: ranks forked from the calling process) or ``"spawn"``.
        kwargs: passed on to the mixin and ``ModelParallelStrategy``.

    Raises:
        ValueError: for an unknown ``start_method``, a mesh size that is not ``"auto"`` or a positive int, the
            invariant mode with ``tensor_parallel_size > 1``; before launch, in the main process, for sizes whose
            product is not the number of processes the Trainer will start (``devices`` x ``num_nodes``).

    Examples:
        >>> strategy = DeterministicModelParallelStrategy(seed=3, tensor_parallel_size=2, start_method="fork")
        >>> strategy.seed, strategy.start_method
        (3, 'fork')
    """

    # With `save_distributed_checkpoint=False` rank 0 writes one file through `checkpoint_io`: atomically, as ours.
    _ldet_file_saves_through_io = True

    def __init__(self, *args: Any, start_method: str = "popen", **kwargs: Any) -> None:
        require(MODEL_PARALLEL)
        if start_method not in START_METHODS:
            raise ValueError(f"`start_method` must be one of {START_METHODS}, got {start_method!r}")
        self.start_method = start_method
        self._ldet_weights_stay_in_ranks = True  # sharded weights are not sent back to a fork/spawn main process
        super().__init__(*args, **kwargs)
        check_mesh_sizes(model_parallel_sizes(self), self.num_nodes, None, self.invariant is not None)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        trainer = module_trainer(self.lightning_module)
        if trainer is not None and not any(isinstance(cb, ReplicaGuard) for cb in trainer.callbacks):
            trainer.callbacks.append(ReplicaGuard())

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Lightning's save; a distributed checkpoint directory is written hidden and published whole.

        See :mod:`~lightning_determinism.checkpoints.publish`: a kill never leaves a torn directory under the final
        name (``last.ckpt/`` rewritten at every save), and the parts carry marks checked before a resume.
        """
        if not saves_distributed_checkpoint(self) or storage_options is not None:
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        step = checkpoint.get("global_step")
        save_published(self, filepath, lambda hidden: super(DeterministicModelParallelStrategy, self)
                       .save_checkpoint(checkpoint, hidden), step if isinstance(step, int) else None)  # fmt: skip

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Lightning's load; a distributed checkpoint into a model ``configure_model`` left unsharded, whole.

        ``configure_model`` commonly shards only when the data-parallel mesh has more than one rank: on one device
        the model's parameters are plain tensors, which Lightning's loader refuses ("Could not find a distributed
        model"). Such a model takes every tensor whole from the shards (and each optimizer its state, keyed by
        parameter name as DCP saved it): the values the ranks held, bit for bit.
        """
        check_before_load(checkpoint_path, self.global_rank)  # a torn or mixed directory: one line, before training
        path = Path(self.broadcast(checkpoint_path))
        if path.is_dir() and self.model is not None and not _has_dtensor(self.model):
            strict = bool(getattr(self.lightning_module, "strict_loading", True))
            return load_into_plain_model(path, self.model, list(self.optimizers), strict)
        return super().load_checkpoint(checkpoint_path, *args, **kwargs)  # type: ignore[no-any-return]

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        # In the main process: one line, not one per rank.
        check_mesh_sizes(model_parallel_sizes(self), self.num_nodes, self._ldet_planned_world_size(),
                         self.invariant is not None)  # fmt: skip
        environment = self.cluster_environment
        if self.start_method != "popen" and environment is not None and not environment.creates_processes_externally:
            launcher = MultiProcessingLauncher(self, start_method=self.start_method)  # type: ignore[arg-type]
            self._launcher = replace_launcher(launcher, self)


def _has_dtensor(module: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(parameter, DTensor) for parameter in module.parameters())


def load_into_plain_model(path: Path, model: Any, optimizers: list[Any], strict: bool = True) -> dict[str, Any]:
    """Load a distributed checkpoint directory into a model whose parameters are plain tensors; the rest returned.

    Every tensor is read whole (:func:`~lightning_determinism.checkpoints.distributed.load_distributed_checkpoint`);
    the optimizers' states, keyed by parameter name, are matched to the parameters by torch's
    ``set_optimizer_state_dict``.

    Returns:
        The checkpoint without its weights and optimizer states (what Lightning's loader returns).

    Raises:
        RuntimeError: when the checkpoint holds another number of optimizer states than the run has optimizers.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    checkpoint = load_distributed_checkpoint(path)
    model.load_state_dict(checkpoint.pop("state_dict"), strict=strict)
    states = checkpoint.pop("optimizer_states")
    if states and len(states) != len(optimizers):
        raise RuntimeError(
            f"{path}: the checkpoint holds {len(states)} optimizer states and the run has {len(optimizers)} optimizers"
        )
    options = StateDictOptions(full_state_dict=True, strict=strict)
    for optimizer, state in zip(optimizers, states, strict=False):  # the strategy's: torch optimizers
        set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=options)
    return checkpoint


def register_model_parallel_strategy() -> list[str]:
    """Register ``model_parallel_deterministic`` in Lightning's ``StrategyRegistry``; safe to call again.

    Returns:
        The registered names.

    Examples:
        >>> register_model_parallel_strategy()
        ['model_parallel_deterministic']
    """
    StrategyRegistry.register(
        "model_parallel_deterministic",
        DeterministicModelParallelStrategy,
        description="DeterministicModelParallelStrategy (FSDP2 + tensor parallel, seeded by the device mesh)",
        override=True,
    )
    return ["model_parallel_deterministic"]


__all__ = ["START_METHODS", "DeterministicModelParallelStrategy", "register_model_parallel_strategy"]
