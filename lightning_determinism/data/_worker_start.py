"""Data-loader workers that never start: CPython's fork deadlock gh-112275, detected and worked around.

Python 3.8 to 3.11 (fixed in 3.12): a worker forked while another thread of the rank (gloo's, taking the GIL from
C++) is creating a Python thread state inherits the thread-list lock locked and waits forever in
``PyOS_AfterFork_Child``. ``benchmarks/soak_fork_fits.py`` met it in about one 2-rank fit in 300; the training loop
then waited for that worker forever. :func:`create_iterator` checks that every forked worker started (a flag each
sets first thing) and, if one has not within :data:`WORKER_START_TIMEOUT_S`, stops the workers and forks them again
from the same RNG states, with a warning.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import warnings
from typing import Any

import torch
import torch.multiprocessing as mp

from lightning_determinism._compat.data import (
    drop_loader_iterator,
    forget_worker_pids,
    loader_iterator,
    shutdown_workers,
    worker_processes,
)
from lightning_determinism._process import die_with_parent
from lightning_determinism.errors import DeterminismWarning

WORKER_START_TIMEOUT_S = 30.0
"""How long forked data-loader workers may take to start before they are started again."""


class StartedFlag:
    """A ``worker_init_fn`` wrapper: the worker marks itself started in shared memory, then runs the user's."""

    def __init__(self, flags: torch.Tensor, inner: Any) -> None:
        self.flags, self.inner = flags, inner

    def __call__(self, worker_id: int) -> None:
        self.flags[worker_id] = 1
        if self.inner is not None:
            self.inner(worker_id)


class PreemptibleWorker:
    """A ``worker_init_fn`` wrapper: the worker ignores ``SIGTERM`` and dies with its rank; then the user's runs.

    SLURM (and Kubernetes) signal every process of a job step at a preemption, data-loader workers included.
    PyTorch's workers die of ``SIGTERM`` and their rank then fails with "DataLoader worker ... exited unexpectedly"
    before a preemption checkpoint can be written. The rank decides instead: it stops at the next step boundary
    (:class:`~lightning_determinism.PreemptionCheckpoint`, or Lightning's own handler) and shuts its workers down
    as usual. A worker whose rank dies (``SIGKILL`` after the grace period) is killed by the kernel with it.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __call__(self, worker_id: int) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        die_with_parent(os.getppid())
        if self.inner is not None:
            self.inner(worker_id)


def preemptible(init: Any) -> Any:
    """``init`` wrapped in :class:`PreemptibleWorker` (once)."""
    return init if isinstance(init, PreemptibleWorker) else PreemptibleWorker(init)


def workers_started(iterator: Any, flags: torch.Tensor, timeout: float) -> bool:
    """Wait until every worker marked itself started (or one died: the DataLoader reports that itself)."""
    deadline = time.monotonic() + timeout
    workers = worker_processes(iterator)
    while not bool(flags.all()):
        if any(not worker.is_alive() for worker in workers) or time.monotonic() > deadline:
            return bool(flags.all()) or any(not worker.is_alive() for worker in workers)
        time.sleep(0.002)
    return True


def create_iterator(loader: Any, create: Any) -> Any:
    """``create()`` the loader's iterator; if a forked worker is stuck, fork the workers again.

    ``loader`` is a converted ``DataLoader`` (:class:`~lightning_determinism.data.resumable.ResumableLoaderMixin`): its
    ``_ldet_snapshot`` / ``_ldet_restore`` give the same RNG states to every attempt.
    """
    workers = int(getattr(loader, "num_workers", 0))
    if workers == 0:
        return create()
    user_fn = getattr(loader, "worker_init_fn", None)
    setattr(loader, "worker_init_fn", preemptible(user_fn))  # noqa: B010  (a DataLoader attribute)
    try:
        return _create_started(loader, create, workers)
    finally:
        setattr(loader, "worker_init_fn", user_fn)  # noqa: B010


def _create_started(loader: Any, create: Any, workers: int) -> Any:
    context = getattr(loader, "multiprocessing_context", None)
    method = context.get_start_method() if context is not None else mp.get_start_method(allow_none=True)
    reuses = getattr(loader, "persistent_workers", False) and loader_iterator(loader) is not None
    if method not in (None, "fork") or reuses:
        return create()
    states = loader._ldet_snapshot(True)
    for attempt in range(3):
        flags = torch.zeros(workers, dtype=torch.uint8).share_memory_()
        user_fn = getattr(loader, "worker_init_fn", None)
        setattr(loader, "worker_init_fn", StartedFlag(flags, user_fn))  # noqa: B010  (a DataLoader attribute)
        try:
            iterator = create()
        finally:
            setattr(loader, "worker_init_fn", user_fn)  # noqa: B010
        if workers_started(iterator, flags, WORKER_START_TIMEOUT_S):
            return iterator
        stuck = [w.pid for w, started in zip(worker_processes(iterator), flags.tolist(), strict=True) if not started]
        warnings.warn(
            f"[pid {os.getpid()}] data-loader workers {stuck} did not start within {WORKER_START_TIMEOUT_S:.0f} s"
            f" (attempt {attempt + 1}): most likely CPython's fork deadlock gh-112275 (Python < 3.12). Killing"
            " them and forking the workers again.",
            DeterminismWarning,
            stacklevel=3,
        )
        forget_worker_pids(iterator)  # else PyTorch's SIGCHLD handler reports the kill
        for pid in stuck:  # SIGKILL: a worker stuck before Python's own setup never runs a SIGTERM handler
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutdown_workers(iterator)
        if getattr(loader, "persistent_workers", False):
            drop_loader_iterator(loader)
        loader._ldet_skip_sampler = None  # a resumed iterator skips again
        loader._ldet_restore(states)  # the same draws as the first attempt
    raise RuntimeError(
        f"Data-loader workers did not start after 3 attempts of {WORKER_START_TIMEOUT_S:.0f} s each; see the"
        " warnings above."
    )


__all__ = [
    "WORKER_START_TIMEOUT_S",
    "PreemptibleWorker",
    "StartedFlag",
    "create_iterator",
    "preemptible",
    "workers_started",
]
