"""What a training step costs on this rank: its peak memory, and the time its collectives took (measured).

Peak memory: on CUDA, ``torch.cuda.max_memory_allocated`` of the step (the peak is reset when a step begins); on
CPU, the process's peak resident set size (``resource.getrusage``: the high-water mark since the process started,
which a step can only raise, not a per-step figure).

Communication: ``torch.profiler`` runs over one step in every ``every`` (steps 1, 1 + every, 1 + 2 every, ...; step 0
carries the warm-up), from the step's beginning to just before the optimizer step (the recorder's own collectives
come after, outside the window), and the durations of the collective operations it saw are summed: on CPU the gloo
worker threads' spans (``gloo:all_reduce``, ``gloo:reduce_scatter``, ...), on CUDA the NCCL kernels' device time,
else the ``c10d``/``all_reduce``/``reduce_scatter``/``all_gather`` operations of the calling thread. Overlapped
communication counts whole: it is time spent communicating, not time the step waited. Other steps record ``None``.
"""

from __future__ import annotations

import os
import resource
import sys
from typing import Any

import torch

COLLECTIVE_MARKERS = ("c10d", "all_reduce", "allreduce", "reduce_scatter", "all_gather", "allgather", "broadcast")
"""Names (lower case) of the profiled operations counted as communication when no backend span was recorded."""
BACKEND_PREFIXES = ("gloo:", "nccl:")
"""The spans a process-group backend records for the work it executes."""
DEFAULT_EVERY = 10
"""Profile one step in this many: the profiler's cost on a profiled step spread below 5 % (benchmarks/baseline.py)."""


def collective_seconds(events: Any) -> float:
    """The summed duration, in seconds, of the collective operations among profiled ``events``.

    Backend spans (``gloo:*`` on CPU; on CUDA, device kernels named ``nccl*``) when there are any: they are the
    executed work, of which the ``c10d::*`` operation on the calling thread is only the dispatch. Otherwise the
    outermost operation whose name contains one of :data:`COLLECTIVE_MARKERS`.

    Examples:
        >>> from types import SimpleNamespace as E
        >>> def event(name, us, parent=None, device="CPU"):
        ...     return E(name=name, time_range=E(elapsed_us=lambda: us), cpu_parent=parent, device_type=device)
        >>> dispatch = event("c10d::allreduce_", 5)
        >>> collective_seconds([dispatch, event("gloo:all_reduce", 250), event("aten::mm", 900)])
        0.00025
        >>> collective_seconds([dispatch, event("c10d::inner_allreduce", 3, parent=dispatch)])
        5e-06
    """
    events = list(events)
    device = [e for e in events if "cuda" in str(e.device_type).lower() and e.name.lower().startswith("nccl")]
    backend = device or [e for e in events if e.name.lower().startswith(BACKEND_PREFIXES)]
    if backend:
        return sum(e.time_range.elapsed_us() for e in backend) / 1e6

    def collective(e: Any) -> bool:
        return any(marker in e.name.lower() for marker in COLLECTIVE_MARKERS)

    def outermost(e: Any) -> bool:
        parent = e.cpu_parent
        while parent is not None:
            if collective(parent):
                return False
            parent = parent.cpu_parent
        return True

    return sum(e.time_range.elapsed_us() for e in events if collective(e) and outermost(e)) / 1e6


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
    """

    def __init__(self, every: int = DEFAULT_EVERY, device: torch.device | None = None) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"`every` must be an int >= 0, got {every!r}")
        self.every = every
        self.device = device if device is not None else torch.device("cpu")
        self.steps: list[tuple[int, float | None]] = []
        self._profiler: Any = None
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
        if self.profiles(step):
            from torch.profiler import ProfilerActivity, profile

            os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # Kineto's "profiler_stop" lines on stderr, every time
            activities = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self._profiler = profile(activities=activities)
            self._profiler.start()

    def pause(self) -> None:
        """Stop measuring communication for this step (what follows is not the step's own work)."""
        self._stop()

    def _stop(self) -> None:
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        profiler.stop()
        self._seconds = collective_seconds(profiler.events())

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
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None


__all__ = [
    "BACKEND_PREFIXES",
    "COLLECTIVE_MARKERS",
    "DEFAULT_EVERY",
    "StepCosts",
    "collective_seconds",
    "peak_rss_bytes",
]
