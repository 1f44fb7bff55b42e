"""Reading and comparing NumericalBaseline files (used by the callback and the command line).

This module is a leaf: it knows json and math, nothing of torch or Lightning.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


class BaselineFileError(ValueError):
    """A baseline file is missing, unreadable or not a baseline: the message names the file and the problem."""


def load_baseline(path: str | Path) -> dict[str, Any]:
    """Read and check a baseline file.

    Raises:
        BaselineFileError: naming the file and what is wrong with it.
    """
    path = Path(path)
    if not path.is_file():
        raise BaselineFileError(f"{path}: no such file")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BaselineFileError(f"{path}: not a baseline file (not JSON: {err})") from None
    if not isinstance(data, dict) or data.get("format") != 1 or not isinstance(data.get("steps"), list):
        raise BaselineFileError(f"{path}: not a baseline file (expected a NumericalBaseline JSON with 'format': 1)")
    for i, step in enumerate(data["steps"]):
        if not isinstance(step, dict) or "loss" not in step or "grad_norms" not in step:
            raise BaselineFileError(f"{path}: step entry {i} is malformed (needs 'loss' and 'grad_norms')")
    return data


def quantities(reference: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(name, reference value, current value)`` for every compared quantity of one step, in a fixed order."""
    # Per-parameter quantities before the global norm, so that a mismatch names the parameter it starts in.
    pairs: list[tuple[str, Any, Any]] = [("loss", reference.get("loss"), current.get("loss"))]
    for group in ("grad_norms", "param_norms"):
        ref_group, cur_group = reference.get(group, {}), current.get(group, {})
        pairs.extend((f"{group}[{name}]", ref_group[name], cur_group.get(name)) for name in sorted(ref_group))
    pairs.append(("grad_norm", reference.get("grad_norm"), current.get("grad_norm")))
    return pairs


def _differs(x: Any, y: Any, rtol: float, atol: float) -> bool:
    if x is None or y is None:
        return x is not y
    if math.isnan(x) and math.isnan(y):
        return False
    return not math.isclose(x, y, rel_tol=rtol, abs_tol=atol)


def first_mismatch(
    reference: dict[str, Any], current: dict[str, Any], rtol: float, atol: float
) -> tuple[str, Any, Any] | None:
    """The first quantity of one step beyond tolerance: ``(name, reference value, current value)``, else None.

    Example:
        >>> first_mismatch({"loss": 1.0}, {"loss": 1.1}, rtol=1e-4, atol=0.0)
        ('loss', 1.0, 1.1)
    """
    return next(((n, x, y) for n, x, y in quantities(reference, current) if _differs(x, y, rtol, atol)), None)


def _rel(a: float, b: float) -> float:
    if a == b:
        return 0.0
    scale = max(abs(a), abs(b))
    return abs(a - b) / scale if scale else math.inf


def compare_baselines(a: dict[str, Any], b: dict[str, Any], rtol: float, atol: float) -> dict[str, Any]:
    """Per-step maximum absolute and relative differences, and the first step and quantity beyond tolerance.

    Raises:
        BaselineFileError: if the files hold different steps or parameter sets.

    Example:
        >>> s = {"step": 0, "loss": 1.0, "grad_norm": 1.0, "grad_norms": {"w": 1.0}, "param_norms": {"w": 2.0}}
        >>> out = compare_baselines({"steps": [s]}, {"steps": [{**s, "loss": 1.5}]}, rtol=1e-4, atol=0.0)
        >>> out["first"]["step"], out["first"]["name"]
        (0, 'loss')
    """
    from_a, from_b = a["steps"], b["steps"]
    if len(from_a) != len(from_b):
        raise BaselineFileError(f"the files hold different numbers of steps: {len(from_a)} and {len(from_b)}")
    rows, first = [], None
    for step_a, step_b in zip(from_a, from_b, strict=True):
        names_a, names_b = set(step_a["grad_norms"]), set(step_b["grad_norms"])
        if names_a != names_b:
            only = sorted(names_a ^ names_b)
            raise BaselineFileError(f"the files hold different parameter sets at step {step_a.get('step')}: {only}")
        max_abs = max_rel = 0.0
        for name, x, y in quantities(step_a, step_b):
            if x is not None and y is not None:
                max_abs, max_rel = max(max_abs, abs(x - y)), max(max_rel, _rel(x, y))
            if first is None and _differs(x, y, rtol, atol):
                diff = abs(x - y) if x is not None and y is not None else math.nan
                first = {"step": step_a.get("step"), "name": name, "a": x, "b": y, "diff": diff}
        rows.append(
            {
                "step": step_a.get("step"),
                "loss_a": step_a["loss"],
                "loss_b": step_b["loss"],
                "max_abs": max_abs,
                "max_rel": max_rel,
                "bitwise_params": step_a.get("param_fingerprints") == step_b.get("param_fingerprints"),
            }
        )
    return {"rows": rows, "first": first}


__all__ = ["BaselineFileError", "compare_baselines", "first_mismatch", "load_baseline", "quantities"]
