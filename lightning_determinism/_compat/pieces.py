"""Every private name of Lightning, Fabric, torch and torchmetrics the package relies on: :data:`PIECES`.

Each :class:`Piece` names the private name (or its shape), says why no public API serves, belongs to one feature of
:mod:`~lightning_determinism._compat.features`, and checks itself against the installed versions (for
:mod:`~lightning_determinism._compat.checks`). Instance-only attributes are checked in the ``__init__`` assigning them.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning
import torch

from lightning_determinism._compat.features import (
    BASELINE,
    BATCH_INVARIANT,
    DTENSOR,
    FABRIC,
    INVARIANT,
    INVARIANT_FSDP2,
    KERNEL,
    LIGHTNING_FLOOR,
    METRICS,
    MODEL_PARALLEL,
    PLOTS,
    PREEMPTION,
    RECOMPUTE,
    TRAINER,
    UNEVEN_STRIDED,
    WORKERS,
)


@dataclass(frozen=True)
class Piece:
    """One private name (or the shape of one) a feature needs, why no public API serves, and how to check it."""

    feature: str
    name: str
    why: str
    present: Callable[[], bool]


def _lookup(path: str) -> Any:
    """``"module:Class.attr"`` -> the object (``ImportError`` or ``AttributeError`` when it is gone)."""
    module, _, qualname = path.partition(":")
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


def _exists(path: str, *params: str) -> Callable[[], bool]:
    """The name exists and, given ``params``, its signature starts with them (positions the package relies on)."""

    def present() -> bool:
        try:
            found = _lookup(path)
            return not params or list(inspect.signature(found).parameters)[: len(params)] == list(params)
        except (ImportError, AttributeError, TypeError, ValueError):
            return False

    return present


def _strided_shard_builds() -> bool:
    """``_StridedShard(dim, split_factor=)`` builds one that says both back (no signature to read on some torch)."""
    try:
        placement = _lookup("torch.distributed.tensor.placement_types:_StridedShard")(1, split_factor=2)
        return (placement.dim, placement.split_factor) == (1, 2)
    except Exception:  # noqa: BLE001  (missing, renamed, or another constructor: the piece is absent)
        return False


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])  # "2.5.0.post0" -> (2, 5, 0)


def _assigned_names(cls: type) -> set[str]:
    names: set[str] = set()
    for klass in cls.__mro__[:-1]:
        init = inspect.unwrap(klass.__dict__.get("__init__", object.__init__))
        names.update(getattr(getattr(init, "__code__", None), "co_names", ()))
    return names


def _foreach_norm_takes_a_dtype() -> bool:
    """``torch._foreach_norm(tensors, 2, dtype=torch.float64)`` runs and gives float64 norms (it has no signature)."""
    import torch

    try:
        return bool(torch._foreach_norm([torch.ones(2)], 2, dtype=torch.float64)[0].dtype == torch.float64)
    except (TypeError, RuntimeError):
        return False


def _worker_info_takes_its_fields() -> bool:
    """``WorkerInfo(id=, num_workers=, seed=, dataset=)`` builds one that reads them back.

    Its signature is ``**kwargs`` up to torch 2.10 and named fields after: construction is what is checked.
    """
    try:
        info = _lookup("torch.utils.data._utils.worker:WorkerInfo")(id=1, num_workers=2, seed=3, dataset="d")
        return (info.id, info.num_workers, info.seed, info.dataset) == (1, 2, 3, "d")
    except (ImportError, AttributeError, TypeError, ValueError):
        return False


def _recompute_hooks() -> bool:
    """The reentrant forward and a non-reentrant generator of a known shape, where every checkpointing form calls."""
    modules = ("torch.utils.checkpoint", "torch.distributed._composable.checkpoint_activation")
    shapes = {
        "_checkpoint_without_reentrant_generator_impl": ("fn", "args", "kwargs", "preserve_rng_state"),
        "_checkpoint_without_reentrant_generator": ("fn", "preserve_rng_state"),
    }

    def generator_ok(module: str) -> bool:
        for name, params in shapes.items():  # the first name present is the one wrapped (_compat.checkpointing)
            if _exists(f"{module}:{name}")():
                found = inspect.signature(_lookup(f"{module}:{name}")).parameters
                return list(found)[: len(params) - 1] == list(params[:-1]) and params[-1] in found
        return False

    return _exists(
        "torch.utils.checkpoint:CheckpointFunction.forward", "ctx", "run_function", "preserve_rng_state"
    )() and all(generator_ok(module) for module in modules)


def _assigns(path: str, *attributes: str) -> Callable[[], bool]:
    """The class's ``__init__`` (its own or a base's) still sets these instance attributes: read from its code."""

    def present() -> bool:
        try:
            return set(attributes) <= _assigned_names(_lookup(path))
        except (ImportError, AttributeError):
            return False

    return present


_PL = "lightning.pytorch"
_DATA = "torch.utils.data.dataloader"
_MP_LAUNCHER = f"{_PL}.strategies.launchers.multiprocessing:_MultiProcessingLauncher"
_SCRIPT_LAUNCHER = f"{_PL}.strategies.launchers.subprocess_script:_SubprocessScriptLauncher"

PIECES: tuple[Piece, ...] = (
    Piece(TRAINER, f"lightning>={LIGHTNING_FLOOR}", "older releases replay an epoch's last batch on resume from a"
          " checkpoint written at that batch (fixed in Lightning 2.5.0, PR #20379)",
          lambda: _release(lightning.__version__) >= _release(LIGHTNING_FLOOR)),
    # Lightning: data loaders
    Piece(TRAINER, "lightning.pytorch.utilities.data._update_dataloader(dataloader, sampler)",
          "rebuilds a DataLoader (a user's subclass too, from its recorded arguments) around a new sampler, as"
          " Lightning injects its own; there is no public way", _exists(f"{_PL}.utilities.data:_update_dataloader",
                                                                         "dataloader", "sampler")),
    Piece(TRAINER, "lightning.fabric.utilities.data._set_sampler_epoch(dataloader, epoch)",
          "sets the epoch of the sampler and of the batch sampler's sampler exactly as the loops do; no public API",
          _exists("lightning.fabric.utilities.data:_set_sampler_epoch", "dataloader", "epoch")),
    Piece(TRAINER, "lightning.fabric.utilities.distributed._DatasetSamplerWrapper._sampler",
          "the user's sampler inside DistributedSamplerWrapper; the wrapper exposes it no other way",
          _assigns("lightning.fabric.utilities.distributed:_DatasetSamplerWrapper", "_sampler")),
    Piece(TRAINER, "lightning.pytorch.utilities.combined_loader.CombinedLoader._mode",
          "whether the training loaders cycle; CombinedLoader has no public accessor",
          _assigns(f"{_PL}.utilities.combined_loader:CombinedLoader", "_mode")),
    Piece(FABRIC, "lightning.fabric.wrappers._FabricDataLoader._dataloader, ._num_iter_calls",
          "the wrapped loader and the count Fabric derives the sampler's epoch from; restoring a run must set it",
          _assigns("lightning.fabric.wrappers:_FabricDataLoader", "_dataloader", "_num_iter_calls")),
    Piece(FABRIC, "lightning.fabric.strategies.ddp.DDPStrategy._backward_sync_control",
          "what `fabric.no_backward_sync` enters; the invariant mode replaces it to reseed each micro-batch (Fabric has"
          " no hook at a micro-batch's start)", _assigns("lightning.fabric.strategies.ddp:DDPStrategy",
                                                          "_backward_sync_control")),
    # Lightning: launchers and strategy hooks the package overrides (a rename would silently disable the override)
    Piece(TRAINER, f"{_MP_LAUNCHER.replace(':', '.')}",
          "the spawn/fork launcher DDP strategies create; subclassed, as Lightning offers no launcher extension point",
          _assigns(_MP_LAUNCHER, "_start_method", "_strategy", "procs")),
    Piece(TRAINER,
          "_MultiProcessingLauncher._wrapping_function(process_idx, trainer, function, args, kwargs, return_queue)",
          "overridden: each rank's entry point (clean gloo exit, die with the parent, a clean SystemExit)",
          _exists(f"{_MP_LAUNCHER}._wrapping_function", "self", "process_idx", "trainer", "function", "args",
                  "kwargs", "return_queue")),
    Piece(TRAINER, "_MultiProcessingLauncher._recover_results_in_main_process(worker_output, trainer)",
          "overridden: turns a rank's clean stop into SystemExit in the main process",
          _exists(f"{_MP_LAUNCHER}._recover_results_in_main_process", "self", "worker_output", "trainer")),
    Piece(MODEL_PARALLEL, "_MultiProcessingLauncher._collect_rank_zero_results(trainer, results)",
          "overridden: a model-parallel run's sharded weights stay in the ranks (no process group in the main one)",
          _exists(f"{_MP_LAUNCHER}._collect_rank_zero_results", "self", "trainer", "results")),
    Piece(MODEL_PARALLEL, "lightning.pytorch.strategies.ModelParallelStrategy._device_mesh",
          "the mesh the strategy built, read before `device_mesh` may be asked for (it raises until then)",
          _assigns(f"{_PL}.strategies:ModelParallelStrategy", "_device_mesh")),
    Piece(TRAINER, f"{_SCRIPT_LAUNCHER.replace(':', '.')}._call_children_scripts",
          "the popen launcher, subclassed and this hook overridden to tell child scripts their parent's pid",
          lambda: _exists(f"{_SCRIPT_LAUNCHER}._call_children_scripts")()
          and _assigns(_SCRIPT_LAUNCHER, "cluster_environment", "num_processes", "num_nodes")()),
    Piece(TRAINER, "lightning.pytorch.strategies.DDPStrategy._configure_launcher, Strategy._launcher",
          "overridden to put the package's launcher in place of Lightning's; no public launcher setting",
          lambda: _exists(f"{_PL}.strategies:DDPStrategy._configure_launcher")()
          and _assigns(f"{_PL}.strategies:Strategy", "_launcher")()),
    Piece(TRAINER, "lightning.pytorch.strategies.DDPStrategy._register_ddp_hooks",
          "overridden: the world-size-invariant mode must keep DDP's float all-reduce from running",
          _exists(f"{_PL}.strategies:DDPStrategy._register_ddp_hooks", "self")),
    # Lightning: the trainer's internals
    Piece(TRAINER, "lightning.pytorch.Trainer._accelerator_connector (.use_distributed_sampler, .cluster_environment)",
          "the Trainer's own settings: no public property for `use_distributed_sampler` or the cluster environment",
          lambda: _assigns(f"{_PL}:Trainer", "_accelerator_connector")()
          and _assigns(f"{_PL}.trainer.connectors.accelerator_connector:_AcceleratorConnector",
                       "use_distributed_sampler", "cluster_environment")()),
    Piece(PREEMPTION,
          "lightning.pytorch.Trainer._checkpoint_connector.hpc_save_path, ._signal_connector._slurm_sigusr_handler_fn,"
          " ._signal_connector._original_handlers",
          "SLURM requeue at a step boundary must go through Lightning's own handler and checkpoint name; after a"
          " preemption checkpoint, the handlers Lightning restores at teardown must keep a repeated signal ignored",
          lambda: _assigns(f"{_PL}:Trainer", "_checkpoint_connector", "_signal_connector")()
          and _exists(f"{_PL}.trainer.connectors.checkpoint_connector:_CheckpointConnector.hpc_save_path")()
          and _exists(f"{_PL}.trainer.connectors.signal_connector:_SignalConnector._slurm_sigusr_handler_fn")()
          and _assigns(f"{_PL}.trainer.connectors.signal_connector:_SignalConnector", "_original_handlers")()),
    Piece(TRAINER,
          "lightning.pytorch.Trainer._checkpoint_connector._parse_ckpt_path(state_fn, ckpt_path, model_provided,"
          " model_connected), .resume_start(checkpoint_path, ...)",
          "ckpt_path='last' is resolved by every rank from the filesystem; the deterministic strategies have rank 0"
          " resolve it and every rank check it loads the same checkpoint (no public hook between the two)",
          lambda: _exists(f"{_PL}.trainer.connectors.checkpoint_connector:_CheckpointConnector._parse_ckpt_path",
                          "self", "state_fn", "ckpt_path", "model_provided", "model_connected")()
          and _exists(f"{_PL}.trainer.connectors.checkpoint_connector:_CheckpointConnector.resume_start",
                      "self", "checkpoint_path")()),
    Piece(TRAINER, "lightning.pytorch.Trainer._teardown, ._results (.batch)",
          "a rank stopping on purpose tears down as Lightning does; `_results.batch` tells a per-step collective",
          lambda: _exists(f"{_PL}:Trainer._teardown")() and _exists(f"{_PL}:Trainer._results")()
          and _assigns(f"{_PL}.trainer.connectors.logger_connector.result:_ResultCollection", "batch")()),
    Piece(TRAINER, "lightning.pytorch.trainer.connectors.accelerator_connector._AcceleratorConnector"
          "._check_config_and_set_final_flags(strategy, ...)",
          "wrapped to add the closest deterministic name to Lightning's refusal of a mistyped one (no public hook)",
          _exists(f"{_PL}.trainer.connectors.accelerator_connector:_AcceleratorConnector"
                  "._check_config_and_set_final_flags", "self", "strategy")),
    Piece(TRAINER, "lightning.pytorch.LightningModule._trainer",
          "the trainer, or None before it is attached (`.trainer` raises instead)",
          _assigns(f"{_PL}:LightningModule", "_trainer")),
    Piece(TRAINER, "lightning.pytorch.loops.fit_loop._FitLoop._should_accumulate, ._combined_loader, .epoch_progress,"
          " .epoch_loop.batch_progress",
          "the loop's progress counters are the only record of where an epoch stands (resume, preemption)",
          lambda: _exists(f"{_PL}.loops.fit_loop:_FitLoop._should_accumulate")()
          and _assigns(f"{_PL}.loops.fit_loop:_FitLoop", "_combined_loader", "epoch_progress", "epoch_loop")()
          and _assigns(f"{_PL}.loops.training_epoch_loop:_TrainingEpochLoop", "batch_progress")()
          and {"ready", "started", "processed", "completed"}
          <= set(getattr(_lookup(f"{_PL}.loops.progress:_ProcessedTracker"), "__dataclass_fields__", {}))),
    Piece(TRAINER, "lightning.pytorch.loops: _FitLoop._restart_stage, .on_run_start, .on_advance_start,"
          " .on_advance_end, ._data_fetcher, ._restarting; _TrainingEpochLoop._restart_stage,"
          " .on_advance_end(data_fetcher), .update_lr_schedulers(interval, update_plateau_schedulers),"
          " ._num_ready_batches_reached, ._batches_that_stepped, ._results (.result_metrics, .meta); _EvaluationLoop"
          ".increment_progress_to_evaluation_end; LightningModule._current_fx_name; _LoggerConnector._callback_metrics",
          "a resumed fit replays what Lightning's restart skips (epoch-start hooks, a fast-forwarded validation, the"
          " epoch-end hooks, a plateau step) with the uninterrupted run's counters; no public hook or view exists",
          lambda: all(_exists(f"{_PL}.loops.fit_loop:_FitLoop.{name}")() for name in (
              "on_run_start", "on_advance_start", "on_advance_end", "reset_restart_stage"))
          and _assigns(f"{_PL}.loops.fit_loop:_FitLoop", "_restart_stage", "_data_fetcher", "_restarting")()
          and _exists(f"{_PL}.loops.training_epoch_loop:_TrainingEpochLoop.on_advance_end", "self", "data_fetcher")()
          and _exists(f"{_PL}.loops.training_epoch_loop:_TrainingEpochLoop.update_lr_schedulers", "self", "interval",
                      "update_plateau_schedulers")()
          and _exists(f"{_PL}.loops.training_epoch_loop:_TrainingEpochLoop._num_ready_batches_reached")()
          and _assigns(f"{_PL}.loops.training_epoch_loop:_TrainingEpochLoop", "_restart_stage",
                       "_batches_that_stepped", "_results")()
          and _exists(f"{_PL}.loops.evaluation_loop:_EvaluationLoop.increment_progress_to_evaluation_end")()
          and _exists(f"{_PL}.trainer.connectors.logger_connector.result:_ResultCollection.result_metrics")()
          and _assigns(f"{_PL}.trainer.connectors.logger_connector.logger_connector:_LoggerConnector",
                       "_callback_metrics")()
          and _assigns(f"{_PL}:LightningModule", "_current_fx_name")()),
    Piece(TRAINER, "lightning DDPStrategy._ddp_comm_hook",
          "a user's DDP communication hook replaces the strategy's layout-independent reduction on > 2 processes",
          _assigns(f"{_PL}.strategies.ddp:DDPStrategy", "_ddp_comm_hook")),
    Piece(TRAINER, "lightning.fabric.utilities.distributed._suggested_max_num_threads(num_processes)",
          "the intra-op threads Lightning gives each rank, to tell a forked rank that would hang in OpenMP",
          _exists("lightning.fabric.utilities.distributed:_suggested_max_num_threads", "num_processes")),
    Piece(PREEMPTION, "lightning.pytorch.Trainer._checkpoint_connector.dump_checkpoint(weights_only)",
          "a preemption during validation is saved by rank 0 alone: trainer.save_checkpoint would wait in a barrier",
          _exists(f"{_PL}.trainer.connectors.checkpoint_connector:_CheckpointConnector.dump_checkpoint",
                  "self", "weights_only")),
    Piece(MODEL_PARALLEL,
          "lightning.pytorch.strategies.ModelParallelStrategy._data_parallel_size, ._tensor_parallel_size (and"
          " Fabric's)", "the mesh sizes as given (\"auto\" or ints), checked against the devices before launch; no"
          " public accessor before the mesh exists",
          lambda: _assigns(f"{_PL}.strategies.model_parallel:ModelParallelStrategy", "_data_parallel_size",
                           "_tensor_parallel_size")()
          and _assigns("lightning.fabric.strategies.model_parallel:ModelParallelStrategy", "_data_parallel_size",
                       "_tensor_parallel_size")()),
    # torch
    Piece(RECOMPUTE, "torch.utils.checkpoint.CheckpointFunction.forward(ctx, run_function, preserve_rng_state),"
          " _checkpoint_without_reentrant_generator_impl(fn, args, kwargs, *, preserve_rng_state) (torch 2.14 and"
          " newer; up to 2.13 _checkpoint_without_reentrant_generator(fn, preserve_rng_state)), also in"
          " torch.distributed._composable.checkpoint_activation",
          "activation checkpointing restores only the default generators for a recomputation; the package's streams"
          " are replayed by wrapping the two functions every checkpointing form calls. The public"
          " checkpoint(context_fn=) serves only the non-reentrant calls that pass it (selective checkpointing passes"
          " its own), not the reentrant form, checkpoint_wrapper's or the composable checkpoint(module)",
          _recompute_hooks),
    Piece(PREEMPTION, "torch.distributed.distributed_c10d._get_default_store(); Store.compare_set, .check",
          "ranks agree to stop inside an evaluation pass through the store, where a collective could pair with a"
          " rank's own", lambda: _exists("torch.distributed.distributed_c10d:_get_default_store")()
          and _exists("torch.distributed:Store.compare_set")() and _exists("torch.distributed:Store.check")()),
    Piece(WORKERS, "torch.utils.data._utils.signal_handling._remove_worker_pids",
          "a stuck worker must be killed without torch's SIGCHLD handler reporting it as a crash",
          _exists("torch.utils.data._utils.signal_handling:_remove_worker_pids")),
    Piece(TRAINER, "torch DataLoader._iterator, ._index_sampler; _BaseDataLoaderIter._sampler_iter, ._num_workers",
          "resuming mid-epoch skips indices in the index sampler (overridden) and draws the first index early",
          lambda: _assigns(f"{_DATA}:DataLoader", "_iterator")()
          and isinstance(inspect.getattr_static(_lookup(f"{_DATA}:DataLoader"), "_index_sampler", None), property)
          and _assigns(f"{_DATA}:_BaseDataLoaderIter", "_sampler_iter", "_num_workers")()),
    Piece(WORKERS, "torch _MultiProcessingDataLoaderIter._workers, ._worker_pids_set, ._shutdown_workers",
          "workers stuck in CPython's fork deadlock (gh-112275) must be found and stopped",
          lambda: _assigns(f"{_DATA}:_MultiProcessingDataLoaderIter", "_workers", "_worker_pids_set")()
          and _exists(f"{_DATA}:_MultiProcessingDataLoaderIter._shutdown_workers")()),
    Piece(WORKERS, "torch.utils.data._utils.worker._worker_info, WorkerInfo(id, num_workers, seed, dataset), "
          "_generate_state(base_seed, worker_id)",
          "a stream resumed on another grid plays the old workers' shards (get_worker_info() must name the old "
          "worker); a resumed worker takes over another worker's role (seeded as torch seeds that worker's numpy)",
          lambda: hasattr(importlib.import_module("torch.utils.data._utils.worker"), "_worker_info")
          and _worker_info_takes_its_fields()
          and _exists("torch.utils.data._utils.worker:_generate_state", "base_seed", "worker_id")()),
    Piece(BASELINE, "torch._foreach_norm(tensors, ord, dtype=)",
          "a baseline's norms of every gradient and parameter in one call (7 per-tensor calls cost 0.2 ms a step, most"
          " of the recorder's time); torch's own clip_grad_norm_ uses it, no public name takes a list",
          lambda: _exists("torch:_foreach_norm")() and _foreach_norm_takes_a_dtype()),
    Piece(INVARIANT, "torch._foreach_copy_(targets, sources), torch._foreach_mul_(tensors, scalar)",
          "world-size-invariant clipping copies every gradient into its float64 workspace and scales every gradient"
          " in one call each, as torch's clip_grad_norm_ does; no public name takes a list",
          lambda: _exists("torch:_foreach_copy_")() and _exists("torch:_foreach_mul_")()),
    Piece(MODEL_PARALLEL,
          "lightning.{pytorch,fabric}.strategies.model_parallel._distributed_checkpoint_save(state, path),"
          " ModelParallelStrategy._save_distributed_checkpoint",
          "a distributed save marks every rank's shard file with its token (the directory's parts are checked to"
          " belong together before a resume); ModelParallelStrategy.save_checkpoint builds the state itself",
          lambda: _exists(f"{_PL}.strategies.model_parallel:_distributed_checkpoint_save", "converted_state", "path")()
          and _exists("lightning.fabric.strategies.model_parallel:_distributed_checkpoint_save")()
          and _assigns(f"{_PL}.strategies:ModelParallelStrategy", "_save_distributed_checkpoint")()
          and _assigns("lightning.fabric.strategies:ModelParallelStrategy", "_save_distributed_checkpoint")()),
    Piece(BASELINE,
          "torch.autograd._prepare_profiler, _enable_profiler(config, activities, scopes), _disable_profiler()"
          " (its events(): name(), duration_ns(), device_type()), torch._C._profiler.RecordScope.USER_SCOPE,"
          " torch.autograd._profiler_enabled()",
          "a baseline's communication time sums the collectives of a profiled step; torch.profiler.profile records"
          " every operator call (40 ms more for a 25 ms GRU step), only the private entry takes the scopes to record"
          " (user scopes: the backends' spans); a profiler the user runs must not be stopped by a nested one (no"
          " public way to ask whether one runs)",
          lambda: all(_exists(f"torch.autograd:{name}")() for name in ("_prepare_profiler", "_enable_profiler",
                                                                       "_disable_profiler", "_profiler_enabled"))
          and "scopes" in (_lookup("torch.autograd:_enable_profiler").__doc__ or "")
          and _exists("torch._C._profiler:RecordScope.USER_SCOPE")()
          and all(hasattr(_lookup("torch._C._autograd:_KinetoEvent"), a) for a in ("name", "duration_ns",
                                                                                    "device_type"))),
    Piece(KERNEL, "torch._dynamo.decorators.maybe_mark_dynamic",
          "no recompile of the perplexity's Inductor kernel per batch size or vocabulary (dynamic=True would make"
          " every size of the caller's graph dynamic too)",
          _exists("torch._dynamo.decorators:maybe_mark_dynamic")),
    Piece(DTENSOR,
          "torch.distributed.tensor.DTensor._op_dispatcher (._custom_op_handlers, ._random_ops), DTensor(local,"
          " spec, requires_grad=), ._local_tensor; _dtensor_spec.DTensorSpec, TensorMeta",
          "DTensor random ops must draw the whole tensor's numbers and keep the shard's slice (stock: the shard's own"
          " draw, another mask per degree); the dispatcher's per-op handlers are the one place to route them",
          lambda: _assigns("torch.distributed.tensor._dispatch:OpDispatcher", "_custom_op_handlers", "_random_ops")()
          and hasattr(_lookup("torch.distributed.tensor:DTensor"), "_op_dispatcher")
          and _exists("torch.distributed.tensor._dtensor_spec:DTensorSpec", "mesh", "placements", "tensor_meta")()
          and _exists("torch.distributed.tensor._dtensor_spec:TensorMeta", "shape", "stride", "dtype")()),
    Piece(DTENSOR, "torch.distributed.tensor.placement_types._StridedShard(dim, split_factor=)",
          "FSDP2 over a tensor-parallel parameter places it with _StridedShard, which is_shard() does not report; a"
          " shard's digest needs its elements' global positions",
          lambda: _strided_shard_builds()),
    Piece(DTENSOR, "torch.distributed.tensor._random._rng_tracker, OffsetBasedRNGTracker(device_mesh, run_state_sync),"
          " is_rng_supported_mesh",
          "on CUDA the tracker DTensor creates at its first random op broadcasts rank 0's generator state, undoing"
          " per-rank seeds; created first without that sync, it keeps them",
          lambda: hasattr(importlib.import_module("torch.distributed.tensor._random"), "_rng_tracker")
          and _exists("torch.distributed.tensor._random:OffsetBasedRNGTracker", "device_mesh",
                      "run_state_sync")()
          and _exists("torch.distributed.tensor._random:is_rng_supported_mesh", "device_mesh")()),
    Piece(INVARIANT, "torch.nn.modules.batchnorm._BatchNorm",
          "the one base of every batch-norm layer (1d/2d/3d, lazy, sync); nothing public covers them all",
          _exists("torch.nn.modules.batchnorm:_BatchNorm")),
    Piece(INVARIANT_FSDP2, "torch.distributed.fsdp.FSDPModule.set_custom_reduce_scatter (public; torch 2.9 and newer)",
          "the invariant mode sums FSDP2's gradients over its own fixed tree; only a custom reduce-scatter lets it",
          _exists("torch.distributed.fsdp:FSDPModule.set_custom_reduce_scatter")),
    Piece(UNEVEN_STRIDED, "torch>=2.10 for a _StridedShard whose dimension does not divide evenly",
          "torch before 2.10 redistributes an FSDP2 x tensor-parallel parameter whose sharded dimension does not divide"
          " by the shards (10 rows over 2 x 2) into wrong values: full_tensor(), and the norms and digests from it",
          lambda: _release(torch.__version__)[:2] >= (2, 10)),
    # torchmetrics
    Piece(METRICS, "torchmetrics.Metric._wrap_update, ._defaults, ._apply(fn, exclude_state), ._plot",
          "exact metrics give their extra update methods torchmetrics' bookkeeping and lock their int64 states",
          lambda: _exists("torchmetrics:Metric._wrap_update")() and _assigns("torchmetrics:Metric", "_defaults")()
          and _exists("torchmetrics:Metric._apply", "self", "fn", "exclude_state")()
          and _exists("torchmetrics:Metric._plot")()),
    Piece(PLOTS, "torchmetrics.utilities.plot._AX_TYPE, _PLOT_OUT_TYPE",
          "the types of `Metric.plot`, which the metrics keep", _exists("torchmetrics.utilities.plot:_PLOT_OUT_TYPE")),
    Piece(BATCH_INVARIANT, "torch.library.Library._destroy",
          "unregisters the mode's kernels at its end: no public way", _exists("torch.library:Library._destroy")),
)  # fmt: skip

__all__ = ["PIECES", "Piece"]
