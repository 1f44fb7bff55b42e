"""What a baseline file says about the run that wrote it: versions, device, mesh, world size, batch, seed, launcher.

A baseline is only a baseline for the configuration that recorded it: record it again whenever any of these changes.
The recorder fills in what it sees (versions and seed from ``determinism_report()``, the device, the world size);
the Trainer callback adds the strategy, launcher, precision and mesh, a hand-written loop gives them to
:meth:`~lightning_determinism.divergence.baseline_recorder.BaselineRecorder.set_run`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

RUN_KEYS = (
    "torch",
    "lightning",
    "lightning_determinism",
    "device",
    "world_size",
    "mesh",
    "batch_shape",
    "seed",
    "strategy",
    "launcher",
    "precision",
)
"""The entries of a file's ``"run"``, in the order they are shown (more may follow)."""


def batch_shapes(batch: Any) -> Any:
    """The shapes of a batch's tensors, in the batch's own structure (lists for tuples); ``None`` for anything else.

    Examples:
        >>> batch_shapes({"x": torch.zeros(2, 3), "y": [torch.zeros(2), "id"]})
        {'x': [2, 3], 'y': [[2], None]}
    """
    if isinstance(batch, torch.Tensor):
        return list(batch.shape)
    if isinstance(batch, Mapping):
        return {str(key): batch_shapes(value) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return [batch_shapes(value) for value in batch]
    return None


def mesh_description(mesh: Any) -> dict[str, Any] | None:
    """A device mesh's shape and dimension names, e.g. ``{"shape": [2, 2], "dim_names": ["data_parallel", ...]}``.

    Examples:
        >>> mesh_description(None) is None
        True
    """
    if mesh is None:
        return None
    names = getattr(mesh, "mesh_dim_names", None)
    return {"shape": [int(n) for n in mesh.shape], "dim_names": list(names) if names else None}


def device_description(device: torch.device) -> str:
    """``"cpu"``, or a CUDA device with its name, e.g. ``"cuda:0 (NVIDIA H200)"``.

    Examples:
        >>> device_description(torch.device("cpu"))
        'cpu'
    """
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    return str(device)


def run_metadata(report: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """The file's ``"run"`` entry: every key of :data:`RUN_KEYS` (``None`` where unknown), then anything else given.

    Examples:
        >>> run = run_metadata({"torch": "2.13.0", "base_seed": 7, "world_size": 1}, {"precision": "32-true"})
        >>> run["seed"], run["precision"], run["strategy"]
        (7, '32-true', None)
    """
    seen = {
        "torch": report.get("torch"),
        "lightning": report.get("lightning"),
        "lightning_determinism": report.get("lightning_determinism"),
        "world_size": report.get("world_size"),
        "seed": report.get("base_seed") if report.get("base_seed") is not None else report.get("pl_global_seed"),
    }
    merged = {**seen, **{key: value for key, value in given.items() if value is not None}}
    return {**{key: merged.get(key) for key in RUN_KEYS}, **merged}


__all__ = ["RUN_KEYS", "batch_shapes", "device_description", "mesh_description", "run_metadata"]
