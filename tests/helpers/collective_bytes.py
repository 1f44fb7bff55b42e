"""The tests' own count of what a rank sends through torch.distributed's collectives (independent of the package).

:func:`wrap_collectives` replaces the Python collectives of ``torch.distributed`` by counting wrappers (install it in
the test process before forking the ranks: each forked rank counts in its own copy). A call adds what a rank sends in
the bandwidth-optimal form of the collective over a group of ``g`` ranks, for an input of ``n`` bytes:

- ``all_reduce``: ``2 (g - 1) / g * n`` (a ring: reduce-scatter then all-gather);
- ``reduce_scatter_*``, ``all_to_all_single``: ``(g - 1) / g * n`` (every chunk but its own leaves the rank);
- ``all_gather_*``: ``(g - 1) * n`` (its chunk to every other rank).

Counting is off until :func:`start` and off again after :func:`stop`; :func:`counts` says what was counted.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

_STATE = {"on": False, "bytes": 0.0, "calls": 0, "by_name": {}}


def _nbytes(tensor: Any) -> int:
    if isinstance(tensor, (list, tuple)):
        return sum(_nbytes(t) for t in tensor)
    return tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0


def _sent(name: str, args: tuple, kwargs: dict) -> float:
    group = kwargs.get("group")
    g = dist.get_world_size(group) if group is not None else dist.get_world_size()
    if name == "all_reduce":
        return 2 * (g - 1) / g * _nbytes(kwargs.get("tensor", args[0] if args else None))
    if name in ("reduce_scatter_single", "reduce_scatter_tensor", "all_to_all_single"):
        source = kwargs.get("input", args[1] if len(args) > 1 else None)
        return (g - 1) / g * _nbytes(source)
    if name == "all_gather":
        return (g - 1) * _nbytes(kwargs.get("tensor", args[1] if len(args) > 1 else None))
    # all_gather_single / all_gather_into_tensor: (output, input)
    return (g - 1) * _nbytes(kwargs.get("input_tensor", kwargs.get("input", args[1] if len(args) > 1 else None)))


NAMES = (
    "all_reduce",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "all_gather",
    "all_gather_single",
    "all_gather_into_tensor",
)


def wrap_collectives(monkeypatch: Any) -> None:
    """Replace every collective of :data:`NAMES` that this torch has by a counting wrapper."""
    for name in NAMES:
        original = getattr(dist, name, None)
        if original is None:
            continue

        @functools.wraps(original)
        def counting(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            if _STATE["on"]:
                sent = _sent(_name, args, kwargs)
                _STATE["bytes"] += sent
                _STATE["calls"] += 1
                _STATE["by_name"][_name] = _STATE["by_name"].get(_name, 0.0) + sent
            return _original(*args, **kwargs)

        monkeypatch.setattr(dist, name, counting)


def start() -> None:
    _STATE.update(on=True, bytes=0.0, calls=0, by_name={})


def stop() -> None:
    _STATE["on"] = False


def counts() -> dict[str, Any]:
    return {"bytes": _STATE["bytes"], "calls": _STATE["calls"], "by_name": dict(_STATE["by_name"])}
