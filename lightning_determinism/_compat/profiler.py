"""torch's profiler for user scopes only: the private calls the step-cost measurement makes (``divergence.step_costs``).

Each goes through :func:`~lightning_determinism._compat.access._private` (a clear error naming the versions if one is
gone).
"""

from __future__ import annotations

from typing import Any

from lightning_determinism._compat.access import _private


def start_scope_profiler(cuda: bool = False, operators: bool = False) -> None:
    """Start torch's profiler for user scopes only; stop it with :func:`stop_scope_profiler`.

    User scopes: ``record_function`` blocks and the process-group backends' spans (``gloo:all_reduce``,
    ``nccl:all_reduce``, ...), and on CUDA the device's kernels; not the thousands of operator calls of a step (each
    one a recorded event under ``torch.profiler.profile``: 40 ms more for a 25 ms GRU step, against about 2 ms) unless
    ``operators``.
    """
    import torch.autograd
    from torch._C._profiler import ProfilerActivity, ProfilerConfig, ProfilerState, RecordScope, _ExperimentalConfig

    activities = {ProfilerActivity.CPU, ProfilerActivity.CUDA} if cuda else {ProfilerActivity.CPU}
    config = ProfilerConfig(ProfilerState.KINETO, False, False, False, False, False, _ExperimentalConfig())
    _private(torch.autograd, "_prepare_profiler")(config, activities)
    scopes = {RecordScope.USER_SCOPE, RecordScope.FUNCTION} if operators else {RecordScope.USER_SCOPE}
    _private(torch.autograd, "_enable_profiler")(config, activities, scopes)


def stop_scope_profiler(keep: Any = None) -> list[tuple[str, float, bool]]:
    """Stop :func:`start_scope_profiler`'s profiler; its events as ``(name, duration in µs, on a device)``.

    ``keep(name)``: only the events it accepts (the others' durations are never read: each read crosses into C++).
    """
    import torch.autograd

    results = _private(torch.autograd, "_disable_profiler")()
    named = ((e, e.name()) for e in results.events())
    return [(name, e.duration_ns() / 1e3, "cuda" in str(e.device_type()).lower())
            for e, name in named if keep is None or keep(name)]  # fmt: skip


def profiler_running() -> bool:
    """Whether a torch profiler is collecting events in this process (a nested one would stop it)."""
    import torch.autograd

    return bool(_private(torch.autograd, "_profiler_enabled")())


__all__ = ["profiler_running", "start_scope_profiler", "stop_scope_profiler"]
