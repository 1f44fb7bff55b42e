"""The accessors that read the private names :mod:`~lightning_determinism._compat.checks` checks at import.

Each reads one name of Lightning, Fabric, torch or torchmetrics at run time and raises the same clear
:class:`~lightning_determinism.errors.IncompatibleVersionError` if it is gone (an instance attribute the import-time
check could only see in an ``__init__``'s code).
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from typing import Any

from lightning_determinism._compat.checks import FabricDataLoader, _message
from lightning_determinism.errors import IncompatibleVersionError


def _private(obj: Any, name: str) -> Any:
    """``obj.<name>``, or a clear error naming the versions where this release has no such attribute."""
    try:
        return getattr(obj, name)
    except AttributeError:
        owner = obj.__qualname__ if isinstance(obj, type) else type(obj).__qualname__
        raise IncompatibleVersionError(_message([f"`{owner}.{name}` (read at run time)"])) from None


def accelerator_connector(trainer: Any) -> Any:
    """The trainer's accelerator connector (``use_distributed_sampler``, ``cluster_environment``)."""
    return _private(trainer, "_accelerator_connector")


def should_accumulate(trainer: Any) -> bool:
    """Whether the current batch only accumulates gradients (the optimizer does not step after it)."""
    return bool(_private(trainer.fit_loop, "_should_accumulate")())


def ddp_comm_hook(strategy: Any) -> Any:
    """The communication hook a user gave Lightning's ``DDPStrategy`` (``None`` if none)."""
    return _private(strategy, "_ddp_comm_hook")


def combined_loader(trainer: Any) -> Any:
    """The fit loop's ``CombinedLoader`` of training loaders (``None`` before the loop set it up)."""
    return _private(trainer.fit_loop, "_combined_loader")


def combined_mode(combined: Any) -> str:
    """A ``CombinedLoader``'s mode (``"max_size_cycle"``, ...)."""
    return str(_private(combined, "_mode"))


def trainer_results(trainer: Any) -> Any:
    """The trainer's logged-results collection of the running loop (``None`` outside one)."""
    return _private(trainer, "_results")


def teardown_trainer(trainer: Any) -> None:
    """Tear the trainer down as Lightning does after a run (a rank that stops on purpose)."""
    _private(trainer, "_teardown")()


def slurm_requeue(trainer: Any, signum: int) -> str:
    """Run Lightning's own SLURM ``SIGUSR1`` handler (checkpoint, requeue); returns the checkpoint's path."""
    path = str(_private(trainer, "_checkpoint_connector").hpc_save_path(trainer.default_root_dir))  # before it saves
    _private(_private(trainer, "_signal_connector"), "_slurm_sigusr_handler_fn")(signum, None)
    return path


def model_parallel_sizes(strategy: Any) -> tuple[Any, Any]:
    """``ModelParallelStrategy``'s ``data_parallel_size`` and ``tensor_parallel_size`` as given (``"auto"`` or ints)."""
    return _private(strategy, "_data_parallel_size"), _private(strategy, "_tensor_parallel_size")


def device_mesh_of(strategy: Any) -> Any:
    """The device mesh of a strategy that builds one (``ModelParallelStrategy``), ``None`` before or without."""
    return getattr(strategy, "_device_mesh", None)


def logs_hyperparameters(obj: Any) -> bool:
    """Whether Lightning logs a module's or datamodule's ``hparams_initial`` (``save_hyperparameters(logger=...)``)."""
    return bool(_private(obj, "_log_hyperparams"))


def launches_nothing(function: Any) -> bool:
    """Whether a Fabric launcher was handed ``fabric.launch()`` without a function (Fabric's ``_do_nothing``).

    Fabric hands its launcher ``partial(fabric._wrap_with_setup, function)``; without a function the loop goes on
    after ``launch()`` returns, so the run has not ended then.
    """
    from lightning.fabric import fabric as module

    nothing = _private(module, "_do_nothing")
    args: tuple[Any, ...] = getattr(function, "args", ())
    return function is nothing or (len(args) > 0 and args[0] is nothing)


def dtensor_local(tensor: Any) -> Any:
    """A DTensor's local tensor itself (``to_local()`` is an autograd function; handlers run below autograd)."""
    return _private(tensor, "_local_tensor")


def is_strided_shard(placement: Any) -> bool:
    """Whether a DTensor placement is FSDP2 x tensor parallel's ``_StridedShard`` (its ``is_shard()`` says no)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(placement, _StridedShard)


def strided_shard_like(placement: Any, dim: int) -> Any:
    """A ``_StridedShard`` with ``placement``'s split factor on dimension ``dim``."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=placement.split_factor)


def dtensor_op_handlers() -> dict[Any, Any]:
    """DTensor's per-op handlers (op -> ``handler(op, args, kwargs)``), consulted before its own dispatch."""
    from torch.distributed.tensor import DTensor

    return _private(_private(DTensor, "_op_dispatcher"), "_custom_op_handlers")  # type: ignore[no-any-return]


def dtensor_random_ops() -> set[Any]:
    """The ops DTensor treats as random (it runs them under its RNG tracker)."""
    from torch.distributed.tensor import DTensor

    return set(_private(_private(DTensor, "_op_dispatcher"), "_random_ops"))


def wrap_dtensor(local: Any, like: Any) -> Any:
    """``local`` as a DTensor on ``like``'s mesh and placements, with ``like``'s shape and stride (no checks)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = DTensorSpec(like.device_mesh, like.placements, TensorMeta(like.shape, like.stride(), local.dtype))
    return DTensor(local, spec, requires_grad=False)  # type: ignore[call-arg]


def keep_dtensor_tracker_from_syncing(mesh: Any) -> bool:
    """On a CUDA mesh, create DTensor's RNG tracker now without its rank-0 state broadcast; ``True`` if created."""
    import torch.distributed.tensor._random as dtensor_random

    if _private(dtensor_random, "_rng_tracker") is not None:
        return False
    if mesh.device_type == "cpu":  # first: torch's check warns on a CPU mesh, where the routed ops are complete
        return False
    if not _private(dtensor_random, "is_rng_supported_mesh")(mesh):
        return False
    tracker = _private(dtensor_random, "OffsetBasedRNGTracker")(mesh, run_state_sync=False)
    dtensor_random._rng_tracker = tracker
    return True


def checkpoint_connector(trainer: Any) -> Any:
    """The trainer's checkpoint connector (how Lightning resolves and loads ``ckpt_path``)."""
    return _private(trainer, "_checkpoint_connector")


def checkpoint_connector_class() -> Any:
    """Lightning's ``_CheckpointConnector`` class (its ``_parse_ckpt_path`` and ``resume_start`` are wrapped)."""
    from lightning.pytorch.trainer.connectors import checkpoint_connector as module

    return _private(module, "_CheckpointConnector")


def ckpt_path_hooks() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``_CheckpointConnector._parse_ckpt_path`` (resolves ``"last"``, ...) and ``.resume_start`` (loads the file)."""
    connector = checkpoint_connector_class()
    return _private(connector, "_parse_ckpt_path"), _private(connector, "resume_start")


def replace_ckpt_path_hooks(parse: Callable[..., Any], resume: Callable[..., Any]) -> None:
    """Put ``parse`` and ``resume`` in place of :func:`ckpt_path_hooks`' two functions, for every trainer."""
    connector = checkpoint_connector_class()
    connector._parse_ckpt_path = parse
    connector.resume_start = resume


def dump_checkpoint(trainer: Any) -> dict[str, Any]:
    """The checkpoint ``trainer.save_checkpoint`` would write, built here without its barrier (rank 0 alone)."""
    return _private(trainer, "_checkpoint_connector").dump_checkpoint(weights_only=False)  # type: ignore[no-any-return]


def default_store() -> Any:
    """The default process group's key-value store: ranks agree through it without a collective."""
    import torch.distributed.distributed_c10d as c10d

    return _private(c10d, "_get_default_store")()


def keep_ignored_after_teardown(trainer: Any, signums: Any) -> None:
    """Have Lightning's signal connector put ``SIG_IGN`` back for ``signums`` at teardown, not its originals."""
    originals = _private(_private(trainer, "_signal_connector"), "_original_handlers")
    for signum in signums:
        originals[signum] = signal.SIG_IGN


def trainer_torch_flags() -> tuple[Any, Any] | None:
    """The ``deterministic`` and ``benchmark`` arguments of the ``Trainer`` being built, ``None`` outside one.

    Lightning applies them to torch in its ``_AcceleratorConnector.__init__`` and keeps neither; a strategy's launcher
    is configured inside that call (``_lazy_init_strategy``), so its frame is on the stack there. Read by name (the
    Trainer's public argument names), from the nearest such frame.
    """
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        owner = type(frame.f_locals.get("self")).__name__ if frame.f_code.co_name == "__init__" else ""
        if owner in ("_AcceleratorConnector", "AcceleratorConnector"):
            local = frame.f_locals
            return local.get("deterministic"), local.get("benchmark")
        frame = frame.f_back  # type: ignore[assignment]
    return None


def module_trainer(module: Any) -> Any:
    """The trainer a ``LightningModule`` is attached to, ``None`` if none (or no module)."""
    return None if module is None else _private(module, "_trainer")


def swap_launcher(strategy: Any, replace: Callable[[Any], Any]) -> None:
    """Put ``replace(launcher)`` in place of the launcher a strategy configured."""
    strategy._launcher = replace(_private(strategy, "_launcher"))


def launcher_start_method(launcher: Any) -> str:
    """A spawn/fork launcher's start method."""
    return str(_private(launcher, "_start_method"))


def launcher_strategy(launcher: Any) -> Any:
    """The strategy a spawn/fork launcher starts ranks for."""
    return _private(launcher, "_strategy")


def wrapped_sampler(sampler: Any) -> Any:
    """The user's sampler inside Lightning's ``DistributedSamplerWrapper``; ``None`` for any other sampler."""
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

    return _private(sampler.dataset, "_sampler") if isinstance(sampler, DistributedSamplerWrapper) else None


def fabric_inner_loader(loader: Any) -> Any:
    """The ``DataLoader`` inside Fabric's wrapper (or the loader itself)."""
    return _private(loader, "_dataloader") if isinstance(loader, FabricDataLoader) else loader


def fabric_iterations(loader: Any) -> int:
    """How many times Fabric's wrapper was iterated; 0 for any other loader."""
    return int(_private(loader, "_num_iter_calls")) if isinstance(loader, FabricDataLoader) else 0


def set_fabric_iterations(loader: Any, count: int) -> None:
    """Set how many times Fabric's wrapper was iterated (Fabric sets the sampler's epoch from it); others: nothing."""
    if isinstance(loader, FabricDataLoader):
        _private(loader, "_num_iter_calls")
        loader._num_iter_calls = count


def replace_backward_sync_control(strategy: Any, replace: Callable[[Any], Any]) -> None:
    """Put ``replace(control)`` in place of what a Fabric strategy's ``no_backward_sync`` enters."""
    strategy._backward_sync_control = replace(_private(strategy, "_backward_sync_control"))


def foreach_norms(tensors: list[Any]) -> list[Any]:
    """Each tensor's 2-norm as a float64 0-d tensor, from one ``torch._foreach_norm`` (``clip_grad_norm_``'s)."""
    import torch

    return _private(torch, "_foreach_norm")(tensors, 2, dtype=torch.float64)  # type: ignore[no-any-return]


def foreach_copy_(targets: list[Any], sources: list[Any]) -> None:
    """Copy every source into its target (dtype converted) in one ``torch._foreach_copy_``."""
    import torch

    _private(torch, "_foreach_copy_")(targets, sources)


def foreach_scale_(tensors: list[Any], factor: float) -> None:
    """Multiply every tensor in place by ``factor`` in one ``torch._foreach_mul_`` (``clip_grad_norm_``'s)."""
    import torch

    _private(torch, "_foreach_mul_")(tensors, factor)


def saves_distributed_checkpoint(strategy: Any) -> bool:
    """Whether a ``ModelParallelStrategy`` (Lightning's or Fabric's) saves a DCP directory, not one file."""
    return bool(_private(strategy, "_save_distributed_checkpoint"))


_DCP_SAVERS = ("lightning.pytorch.strategies.model_parallel", "lightning.fabric.strategies.model_parallel")


@contextlib.contextmanager
def extra_distributed_entries(entries: dict[str, Any]) -> Iterator[None]:
    """While open, the DCP saves of Lightning's and Fabric's ``ModelParallelStrategy`` add ``entries`` to the state.

    Both build the state they hand ``_distributed_checkpoint_save(state, path)`` inside ``save_checkpoint``; no
    argument adds to it. The entries land in this rank's shard file (each rank its own keys).
    """
    import importlib

    modules = [importlib.import_module(name) for name in _DCP_SAVERS]
    originals = [_private(module, "_distributed_checkpoint_save") for module in modules]
    for module, original in zip(modules, originals, strict=True):

        def save(state: dict[str, Any], path: Any, _original: Any = original) -> None:
            _original({**state, **entries}, path)

        module._distributed_checkpoint_save = save  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for module, original in zip(modules, originals, strict=True):
            module._distributed_checkpoint_save = original  # type: ignore[attr-defined]


def metric_defaults(metric: Any) -> dict[str, Any]:
    """A torchmetrics ``Metric``'s state defaults (what ``reset()`` restores)."""
    return _private(metric, "_defaults")  # type: ignore[no-any-return]


__all__ = [
    "trainer_torch_flags",
    "accelerator_connector",
    "checkpoint_connector",
    "checkpoint_connector_class",
    "ckpt_path_hooks",
    "combined_loader",
    "combined_mode",
    "ddp_comm_hook",
    "default_store",
    "device_mesh_of",
    "dtensor_local",
    "dtensor_op_handlers",
    "dtensor_random_ops",
    "dump_checkpoint",
    "extra_distributed_entries",
    "fabric_inner_loader",
    "fabric_iterations",
    "foreach_copy_",
    "foreach_norms",
    "foreach_scale_",
    "is_strided_shard",
    "keep_dtensor_tracker_from_syncing",
    "keep_ignored_after_teardown",
    "launcher_start_method",
    "launcher_strategy",
    "launches_nothing",
    "logs_hyperparameters",
    "metric_defaults",
    "module_trainer",
    "replace_ckpt_path_hooks",
    "replace_backward_sync_control",
    "saves_distributed_checkpoint",
    "set_fabric_iterations",
    "should_accumulate",
    "slurm_requeue",
    "strided_shard_like",
    "swap_launcher",
    "teardown_trainer",
    "trainer_results",
    "wrap_dtensor",
    "wrapped_sampler",
]
