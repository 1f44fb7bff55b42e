"""Deterministic backends: debug modes, the flags they set, and a report of every flag that matters.

This module is a leaf: it knows torch, not Lightning's strategies.
"""

from __future__ import annotations

import os
import platform
import warnings
from typing import Any, Literal, Union

import numpy as np
import torch
import torch.distributed as dist

from lightning_determinism.errors import DeterminismWarning
from lightning_determinism.seeding.record import current_seeds

DebugMode = Union[Literal["default", "warn", "error", 0, 1, 2], None]  # noqa: UP007  (a runtime alias on 3.10)
"""``None`` (touch nothing), ``"default"``/0, ``"warn"``/1 or ``"error"``/2, as torch's debug modes."""

_MODES = {"default": 0, "warn": 1, "error": 2, 0: 0, 1: 1, 2: 2}
_MODE_NAMES = {0: "default", 1: "warn", 2: "error"}
_CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"
_CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")


def normalize_debug_mode(debug_mode: object) -> int | None:
    """Map a debug mode to ``None``, 0, 1 or 2.

    Raises:
        ValueError: for anything else, listing the accepted values.

    Examples:
        >>> normalize_debug_mode("warn")
        1
        >>> normalize_debug_mode(None) is None
        True
        >>> normalize_debug_mode("strict")
        Traceback (most recent call last):
        ...
        ValueError: `debug_mode` must be one of None, 'default', 'warn', 'error', 0, 1, 2, got 'strict'
    """
    if debug_mode is None:
        return None
    if not isinstance(debug_mode, bool) and isinstance(debug_mode, (str, int)) and debug_mode in _MODES:
        return _MODES[debug_mode]
    raise ValueError(f"`debug_mode` must be one of None, 'default', 'warn', 'error', 0, 1, 2, got {debug_mode!r}")


def debug_mode_name(debug_mode: object) -> str:
    """The readable name of a debug mode: ``"None"``, ``"default"``, ``"warn"`` or ``"error"``.

    Examples:
        >>> debug_mode_name(2)
        'error'
    """
    mode = normalize_debug_mode(debug_mode)
    return "None" if mode is None else _MODE_NAMES[mode]


def _set_tf32(enabled: bool) -> None:
    # TF32 rounds float32 matmul inputs to 10 mantissa bits on Ampere and newer: results then differ from
    # a float32 reference and across GPU generations.
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def set_cublas_workspace() -> None:
    """Set ``CUBLAS_WORKSPACE_CONFIG=":4096:8"`` unless it holds a deterministic value; warn if CUDA is up."""
    current = os.environ.get(_CUBLAS_ENV)
    if current in _CUBLAS_DETERMINISTIC:
        return  # the user's own deterministic choice (":16:8" saves memory) is kept
    os.environ[_CUBLAS_ENV] = ":4096:8"
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        warnings.warn(
            f"{_CUBLAS_ENV} was set to ':4096:8' after CUDA was initialised; cuBLAS handles created before may stay"
            f" nondeterministic. Set it (or call set_seed/configure_determinism) before the first CUDA call.",
            DeterminismWarning,
            stacklevel=3,
        )


def configure_determinism(debug_mode: DebugMode) -> int | None:
    """Set the backend flags for ``debug_mode`` and return it as ``None``/0/1/2.

    - ``None``: touches nothing.
    - ``"default"``/0: deterministic algorithms off, cuDNN benchmark on (fast, not reproducible).
    - ``"warn"``/1 and ``"error"``/2: ``torch.use_deterministic_algorithms(True, warn_only=mode == 1)``, cuDNN
      deterministic on and benchmark off, TF32 off for matmul and cuDNN, and ``CUBLAS_WORKSPACE_CONFIG=":4096:8"``
      unless it already holds ``":16:8"``. Setting it after CUDA was initialised warns
      (:class:`~lightning_determinism.DeterminismWarning`).

    Raises:
        ValueError: if ``debug_mode`` is not an accepted value.

    Examples:
        >>> configure_determinism("error")
        2
        >>> torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark
        (True, False)
        >>> configure_determinism("default")
        0
        >>> torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark
        (False, True)
        >>> torch.backends.cudnn.benchmark = False
    """
    mode = normalize_debug_mode(debug_mode)
    if mode is None:
        return None
    if mode == 0:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False
        torch.backends.cudnn.benchmark = True
        return mode
    set_cublas_workspace()
    torch.use_deterministic_algorithms(True, warn_only=mode == 1)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    _set_tf32(False)
    return mode


def _version(module_name: str) -> str | None:
    try:
        module = __import__(module_name)
    except ImportError:
        return None
    return str(getattr(module, "__version__", None))


def determinism_report() -> dict[str, Any]:
    """Every flag that decides reproducibility, as a plain JSON-serialisable dict.

    It holds the versions (python, torch, lightning, numpy, torchmetrics, the package), the
    deterministic-algorithm flags, cuDNN and TF32 flags, ``CUBLAS_WORKSPACE_CONFIG``, ``PL_GLOBAL_SEED``, CUDA
    availability, and the base seed, local seed, rank and world size in effect. Paste it into a bug report.

    Examples:
        >>> import json
        >>> report = determinism_report()
        >>> report["deterministic_algorithms"] in (True, False)
        True
        >>> json.loads(json.dumps(report)) == report
        True
    """
    from lightning_determinism.__about__ import __version__

    rank, world_size = (
        (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
    )
    cudnn_available = torch.backends.cudnn.is_available()
    cuda_available = torch.cuda.is_available()
    return {
        "python": platform.python_version(),
        "torch": str(torch.__version__),  # a TorchVersion would not load under weights_only=True
        "lightning": _version("lightning"),
        "numpy": np.__version__,
        "torchmetrics": _version("torchmetrics"),
        "lightning_determinism": __version__,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "deterministic_debug_mode": torch.get_deterministic_debug_mode(),
        "fill_uninitialized_memory": bool(torch.utils.deterministic.fill_uninitialized_memory),  # type: ignore[attr-defined]
        "cudnn_available": cudnn_available,
        "cudnn_version": torch.backends.cudnn.version() if cudnn_available else None,
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "cuda_matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cublas_workspace_config": os.environ.get(_CUBLAS_ENV),
        "pl_global_seed": os.environ.get("PL_GLOBAL_SEED"),
        "cuda_available": cuda_available,
        "cuda_device_count": torch.cuda.device_count() if cuda_available else 0,
        "num_threads": torch.get_num_threads(),
        **current_seeds(),
        "rank": rank,
        "world_size": world_size,
    }


__all__ = [
    "DebugMode",
    "configure_determinism",
    "debug_mode_name",
    "determinism_report",
    "normalize_debug_mode",
    "set_cublas_workspace",
]
