"""How the deterministic strategies start their ranks: clean exits, no orphans, no forked OpenMP hang.

Lightning's own launchers, with three things added:

- **clean gloo exits**: a rank destroys its gloo process group before it exits; otherwise gloo's threads are
  sometimes torn down mid-flight and the process dies of ``terminate called without an active exception``.
- **no orphans**: on Linux every rank a launcher starts (fork, spawn, or the popen launcher's child scripts) is
  killed when the process that started it dies (``prctl(PR_SET_PDEATHSIG, SIGKILL)``). Killing a run's main process
  no longer leaves ranks behind, blocked in a collective until someone finds them with ``kill -9``. A ``SIGTERM`` to
  the main process of a fork or spawn run is passed on to the ranks, which stop (or checkpoint, with
  :class:`~lightning_determinism.PreemptionCheckpoint`) as they would under popen.
- **no forked OpenMP hang**: GNU OpenMP (PyTorch's intra-op thread pool on Linux) cannot be used after ``fork()``
  once the parent has started its threads: the child's first parallel region waits forever. Plain Lightning's
  ``ddp_fork`` hangs the same way. When the parent already runs threads and a forked rank would use more than one
  intra-op thread, that rank runs with one thread instead, with a warning.
"""

from __future__ import annotations

import atexit
import inspect
import os
import signal
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_determinism._compat.access import launcher_start_method, launcher_strategy, teardown_trainer
from lightning_determinism._compat.checks import (
    MultiProcessingLauncher,
    SubprocessScriptLauncher,
    suggested_max_num_threads,
)
from lightning_determinism._process import die_with_parent
from lightning_determinism.checkpoints.io import check_resume_path, finish_interrupted_publishes_of
from lightning_determinism.errors import DeterminismWarning
from lightning_determinism.strategies.resume_path import resolve_before_launch

PARENT_PID_ENV = "LDET_LAUNCHER_PID"
"""Set for the popen launcher's child scripts: the pid of the rank-0 process that started them."""

_EXIT_HOOK_REGISTERED = False


def destroy_gloo_group() -> None:
    """Destroy the default process group if it is a live gloo one."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
        dist.destroy_process_group()


def destroy_gloo_group_at_exit() -> None:
    """Destroy a live gloo group when the interpreter exits (popen and torchrun ranks); registered once."""
    global _EXIT_HOOK_REGISTERED
    if not _EXIT_HOOK_REGISTERED:
        atexit.register(destroy_gloo_group)
        _EXIT_HOOK_REGISTERED = True


def running_threads() -> int:
    """How many threads this process runs now (Linux; 1 where it cannot be told)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def _intended_threads(num_processes: int) -> int:
    """The intra-op threads Lightning would give each rank (``OMP_NUM_THREADS`` or the CPUs shared out)."""
    env = os.environ.get("OMP_NUM_THREADS")
    if env is not None and env.isdigit():
        return max(1, int(env))
    return suggested_max_num_threads(num_processes)


class CleanExitLauncher(MultiProcessingLauncher):
    """Lightning's spawn/fork launcher whose ranks exit cleanly, die with the main process and do not hang."""

    _ldet_parent_pid: int = 0
    _ldet_single_thread: bool = False

    @override
    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        args, kwargs = check_before_launch(self._strategy, trainer, args, function, kwargs)  # type: ignore[attr-defined]
        self._ldet_parent_pid = os.getpid()  # read by the ranks: forked memory, or pickled with the launcher
        threads = running_threads()
        self._ldet_single_thread = (
            launcher_start_method(self) == "fork"
            and threads > 1
            and _intended_threads(launcher_strategy(self).num_processes) > 1
        )
        if self._ldet_single_thread:
            warnings.warn(
                f"ddp_fork: this process already runs {threads} threads (torch's OpenMP pool among them) and GNU"
                " OpenMP hangs in a forked child that uses more than one thread; each forked rank runs with one"
                " intra-op thread. For more threads per rank use a spawn or popen strategy"
                " (ddp_spawn_deterministic, ddp_deterministic), or fork before the first multi-threaded torch call.",
                DeterminismWarning,
                stacklevel=4,  # the user's trainer.fit(...) line
            )
        steps = getattr(launcher_strategy(self), "_ldet_steps", None)  # the seeding steps of a deterministic one
        if steps is not None:
            steps.prepare_launch()
        previous = self._forward_sigterm()
        stopping = False
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        except SystemExit:
            stopping = True  # the ranks stopped on purpose (a preemption): a repeated SIGTERM must not kill the exit
            raise
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, signal.SIG_IGN if stopping else previous)
            if steps is not None:  # this process ran no rank and no teardown: what the strategy set here goes
                steps.restore_env()

    def _forward_sigterm(self) -> Any:
        """In the main process, pass SIGTERM on to the ranks (which checkpoint or stop) instead of dying of it."""
        if threading.current_thread() is not threading.main_thread():
            return None

        def forward(signum: int, frame: Any) -> None:
            for process in getattr(self, "procs", []):
                if process.is_alive() and process.pid is not None:
                    os.kill(process.pid, signum)

        return signal.signal(signal.SIGTERM, forward)

    @override
    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        die_with_parent(self._ldet_parent_pid)
        if self._ldet_single_thread:
            torch.set_num_threads(1)
            os.environ["OMP_NUM_THREADS"] = "1"  # Lightning then leaves the thread count alone
        try:
            super()._wrapping_function(*args, **kwargs)
        except SystemExit as stop:  # a rank asked to stop cleanly (PreemptionCheckpoint): tear down, tell the parent
            process_idx, trainer, return_queue = args[0], args[1], args[5]
            if trainer is not None:
                teardown_trainer(trainer)
            if process_idx == 0:
                return_queue.put(_Stopped(stop.code))
        destroy_gloo_group()

    @override
    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> Any:
        if not getattr(self._strategy, "_ldet_weights_stay_in_ranks", False):  # type: ignore[attr-defined]
            return super()._collect_rank_zero_results(trainer, results)
        # Sharded (DTensor) weights cannot be sent to a main process without a process group: Lightning sends the
        # weights after `fit` only, so the collection runs as for another stage.
        fn = trainer.state.fn
        trainer.state.fn = TrainerFn.VALIDATING
        try:
            return super()._collect_rank_zero_results(trainer, results)
        finally:
            trainer.state.fn = fn

    @override
    def _recover_results_in_main_process(self, worker_output: Any, trainer: Any) -> None:
        if isinstance(worker_output, _Stopped):
            raise SystemExit(worker_output.code)
        super()._recover_results_in_main_process(worker_output, trainer)


class _Stopped:
    """What rank 0 sends the main process instead of its results when the ranks exited on purpose."""

    def __init__(self, code: Any) -> None:
        self.code = code


class ParentTrackingScriptLauncher(SubprocessScriptLauncher):
    """Lightning's popen launcher whose child scripts learn the pid of the process that started them."""

    def __init__(self, *args: Any, strategy: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ldet_strategy = strategy

    @override
    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if not self.cluster_environment.creates_processes_externally:  # only the main process: not a child script
            args, kwargs = check_before_launch(self._ldet_strategy, trainer, args, function, kwargs)
        return super().launch(function, *args, trainer=trainer, **kwargs)

    @override
    def _call_children_scripts(self) -> None:
        os.environ[PARENT_PID_ENV] = str(os.getpid())
        try:
            super()._call_children_scripts()
        finally:
            os.environ.pop(PARENT_PID_ENV, None)


def check_before_launch(
    strategy: Any,
    trainer: Any,
    args: tuple[Any, ...],
    function: Callable[..., Any] | None = None,
    kwargs: dict[str, Any] | None = None,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Refuse in the main process, before the ranks exist, what every rank would refuse: one error, not one a rank.

    The strategy checks its configuration (``args[0]``: the model); a ``ckpt_path`` of ``function`` (the Trainer's
    ``_fit_impl``, ``_validate_impl``, ...; found by name in its signature) of ``"last"`` or ``"hpc"`` is resolved
    here, once (:func:`~lightning_determinism.strategies.resume_path.resolve_before_launch`), and the path that is
    missing or damaged is refused (:func:`~lightning_determinism.checkpoints.io.check_resume_path`).

    Returns:
        ``args`` and ``kwargs`` for ``function``, with the resolved ``ckpt_path`` in place of ``"last"``.
    """
    kwargs = dict(kwargs or {})
    check = getattr(strategy, "check_before_launch", None)
    if check is not None and trainer is not None:
        check(trainer, args[0] if args else None)
    if function is None or strategy is None:
        return args, kwargs
    try:
        bound = inspect.signature(function).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):  # not a function of the Trainer's: nothing to look for
        return args, kwargs
    ckpt_path = bound.arguments.get("ckpt_path")
    if ckpt_path == "last":  # before anyone looks for the newest last*.ckpt
        finish_interrupted_publishes_of(trainer)
    if getattr(strategy, "_ldet_one_checkpoint", False):
        resolved = resolve_before_launch(trainer, ckpt_path)
        if resolved is not ckpt_path:
            bound.arguments["ckpt_path"] = ckpt_path = resolved
            args, kwargs = tuple(bound.args), dict(bound.kwargs)
    check_resume_path(strategy, ckpt_path)
    return args, kwargs


def adopt_parent_from_env() -> None:
    """In a popen child script: die with the rank-0 process that started it (:class:`ParentTrackingScriptLauncher`)."""
    parent = os.environ.pop(PARENT_PID_ENV, None)
    if parent is not None and parent.isdigit():
        die_with_parent(int(parent))


def replace_launcher(launcher: Any, strategy: Any) -> Any:
    """The package's launcher in place of Lightning's own spawn/fork or popen launcher; anything else unchanged."""
    if type(launcher) is MultiProcessingLauncher:
        return CleanExitLauncher(strategy, start_method=launcher_start_method(launcher))  # type: ignore[arg-type]
    if type(launcher) is SubprocessScriptLauncher:
        return ParentTrackingScriptLauncher(
            launcher.cluster_environment, launcher.num_processes, launcher.num_nodes, strategy=strategy
        )
    return launcher


__all__ = [
    "PARENT_PID_ENV",
    "CleanExitLauncher",
    "ParentTrackingScriptLauncher",
    "adopt_parent_from_env",
    "check_before_launch",
    "destroy_gloo_group",
    "destroy_gloo_group_at_exit",
    "die_with_parent",
    "replace_launcher",
    "running_threads",
]
