"""What a training step costs on this rank: its peak memory, and the time its collectives took (measured).

Peak memory: on CUDA, ``torch.cuda.max_memory_allocated`` of the step (the peak is reset when a step begins); on
CPU, the process's peak resident set size (``resource.getrusage``: the high-water mark since the process started,
which a step can only raise, not a per-step figure).

Communication: torch's profiler runs over one step in every ``every`` (steps 1, 1 + every, 1 + 2 every, ...; step 0
carries the warm-up), from the step's beginning to just before the optimizer step (the recorder's own collectives
come after, outside the window), and the durations of the collective operations it saw are summed: on CPU the gloo
worker threads' spans (``gloo:all_reduce``, ``gloo:reduce_scatter``, ...), on CUDA the NCCL kernels' device time,
else the ``c10d::*`` operations of the calling thread. Under gloo and NCCL the profiler records user scopes only
(the backends' spans are user scopes; the step's thousands of operator calls are not recorded: about 2 ms more for
a 25 ms step, against 40 ms with ``torch.profiler.profile``); under another backend, operators too (its
``c10d::*`` dispatches). Overlapped communication counts whole: it is time spent communicating, not time the step
waited. Other steps record ``None``, and so does a profiled step while another profiler runs (Lightning's
``profiler="pytorch"``: the two cannot nest). Without a process group of more than one rank a step has no one to
communicate with: its profiled steps record ``0.0``, unprofiled.
"""

from __future__ import annotations

import math
import resource
import sys
from typing import Any

import torch
import torch.distributed as dist

from lightning_determinism._compat.profiler import profiler_running, start_scope_profiler, stop_scope_profiler
from lightning_determinism._process import distributed

BACKEND_PREFIXES = ("gloo:", "nccl:")
"""The spans a process-group backend records for the work it executes (``gloo:all_reduce``, ...)."""
DISPATCH_PREFIX = "c10d::"
"""The process-group operations on the calling thread (``c10d::allreduce_``): counted only without backend spans."""
DEFAULT_EVERY = 10
"""Profile one step in this many (steps 1, 11, 21, ...): see docs/divergence.md for what it costs."""


def _may_be_a_collective(name: str) -> bool:
    """Whether :func:`collective_seconds` may count an event of this name (the rest are not read further)."""
    return name.startswith((*BACKEND_PREFIXES, DISPATCH_PREFIX)) or name.lower().startswith("nccl")


def collective_seconds(events: Any) -> float:
    """The summed duration, in seconds, of the collectives among profiled ``(name, µs, on a device)`` events.

    Backend spans when there are any: on CUDA the device kernels named ``nccl*``, else the ``gloo:*``/``nccl:*``
    spans of the backend's threads; they are the executed work, of which the ``c10d::*`` operation on the calling
    thread is only the dispatch. Without them (another backend), the ``c10d::*`` operations.

    Examples:
        >>> collective_seconds([("c10d::allreduce_", 5.0, False), ("gloo:all_reduce", 250.0, False),
        ...                     ("aten::mm", 900.0, False)])
        0.00025
        >>> collective_seconds([("c10d::allreduce_", 5.0, False), ("aten::mm", 900.0, False)])
        5e-06
    """
    events = list(events)
    device = [us for name, us, on_device in events if on_device and name.lower().startswith("nccl")]
    backend = device or [us for name, us, on_device in events if not on_device and name.startswith(BACKEND_PREFIXES)]
    if backend:
        return math.fsum(backend) / 1e6
    return math.fsum(us for name, us, on_device in events if not on_device and name.startswith(DISPATCH_PREFIX)) / 1e6


def peak_rss_bytes() -> int:
    """This process's peak resident set size since it started (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


class StepCosts:
    """Peak memory and measured communication time of each step of this rank.

    Call :meth:`begin` when a step begins, :meth:`pause` before work of one's own that must not be measured (the
    recorder's collectives), :meth:`end` after the step; :attr:`steps` holds one ``(peak bytes, seconds or None)``
    per ended step.

    Args:
        every: profile one step in ``every`` (0: never).
        device: where the model lives (CUDA: per-step peaks of the caching allocator; else the process's peak RSS).

    Examples:
        >>> costs = StepCosts(every=0, device=torch.device("cpu"))
        >>> costs.begin(0); costs.pause(); costs.end()
        >>> peak, seconds = costs.steps[0]
        >>> peak > 0, seconds is None, costs.memory_kind
        (True, True, 'cpu_peak_rss_of_process')
        >>> costs = StepCosts(every=1); costs.begin(1); costs.pause(); costs.end()
        >>> costs.steps[0][1]  # no other rank: nothing to communicate, nothing profiled
        0.0
    """

    def __init__(self, every: int = DEFAULT_EVERY, device: torch.device | None = None) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"`every` must be an int >= 0, got {every!r}")
        self.every = every
        self.device = device if device is not None else torch.device("cpu")
        self.steps: list[tuple[int, float | None]] = []
        self._profiling = False
        self._seconds: float | None = None
        self._step: int | None = None

    @property
    def memory_kind(self) -> str:
        """What the peak figures are: ``"cuda_max_allocated_per_step"`` or ``"cpu_peak_rss_of_process"``."""
        return "cuda_max_allocated_per_step" if self.device.type == "cuda" else "cpu_peak_rss_of_process"

    def profiles(self, step: int) -> bool:
        """Whether step ``step`` is one of the profiled ones (1, 1 + every, ...; every step when ``every == 1``)."""
        return self.every > 0 and (self.every == 1 or step % self.every == 1)

    def begin(self, step: int) -> None:
        """A step begins: reset the CUDA peak; start the profiler if the step is a profiled one."""
        if self._step == step:
            return  # begun already (a loop may call it for every micro-batch)
        self._stop()
        self._step, self._seconds = step, None
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        if not self.profiles(step):
            return
        if not distributed():
            self._seconds = 0.0  # no other rank: nothing to communicate (a world of one copies in place)
        elif not profiler_running():  # the user's own (nested, it would stop theirs): this step goes unmeasured
            operators = str(dist.get_backend()) not in ("gloo", "nccl")  # spans of their own: user scopes suffice
            start_scope_profiler(cuda=self.device.type == "cuda", operators=operators)
            self._profiling = True

    def pause(self) -> None:
        """Stop measuring communication for this step (what follows is not the step's own work)."""
        self._stop()

    def _stop(self) -> None:
        if not self._profiling:
            return
        self._profiling = False
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._seconds = collective_seconds(stop_scope_profiler(keep=_may_be_a_collective))

    def end(self) -> None:
        """The step ended: keep its peak memory and communication time."""
        self._stop()
        if self.device.type == "cuda":
            peak = int(torch.cuda.max_memory_allocated(self.device))
        else:
            peak = peak_rss_bytes()
        self.steps.append((peak, self._seconds))
        self._step, self._seconds = None, None

    def close(self) -> None:
        """Stop a profiler still running (a run that ended inside a step)."""
        if self._profiling:
            self._profiling = False
            stop_scope_profiler(keep=lambda name: False)


__all__ = ["BACKEND_PREFIXES", "DEFAULT_EVERY", "DISPATCH_PREFIX", "StepCosts", "collective_seconds", "peak_rss_bytes"]
