"""NumericalBaseline files: the format, its default tolerances, reading, describing and comparing them.

Used by the callback (writing, whole or not at all by
:func:`~lightning_determinism.checkpoints.atomic.write_atomically`; comparing a run) and by the command line (comparing
two files). A non-finite value (NaN, ``inf``) is never "equal": a divergence finder that passes NaN is worse than none.
Identical non-finite values can be accepted on request (``nonfinite_equal=True``).

This module is a leaf: it knows json and math, nothing of torch or Lightning.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

FORMAT = 2
"""The version of the file format written (``{"format": 2, "world_size", "run": {...}, "steps": [...], "report"}``)."""
READABLE_FORMATS = (1, 2)
"""The versions read: format 1 (before whole-tensor norms, digests, costs and the run's metadata) compares as before;
its ``param_fingerprints`` are not comparable with format 2's ``param_digests`` (no "bitwise" verdict between them)."""

# float32, one process vs DDP on the same global batch: the gradient all-reduce sums in another order (relative
# error ~1e-7 per step), which a few optimizer steps amplify; 1e-4 relative leaves two orders of magnitude for that
# while a real bug (a missing all-reduce, a wrong batch, a different dropout mask) moves values by 1e-2 or more.
DEFAULT_RTOL = 1e-4
"""Default relative tolerance of a comparison."""
DEFAULT_ATOL = 1e-6
"""Default absolute tolerance of a comparison."""


class BaselineFileError(ValueError):
    """A baseline file is missing, unreadable or not a baseline: the message names the file and the problem."""


_TORCH_FILE_MAGIC = (b"PK\x03\x04", b"\x80\x02", b"\x80\x04", b"\x80\x05")  # torch.save's zip; a legacy pickle


def _is_checkpoint(path: Path) -> bool:
    """A file ``torch.save`` wrote, or a distributed (DCP) checkpoint directory."""
    if path.is_dir():
        return (path / ".metadata").is_file() or (path / "meta.pt").is_file()
    try:
        with path.open("rb") as f:
            return f.read(4).startswith(_TORCH_FILE_MAGIC)
    except OSError:
        return False


def load_baseline(path: str | Path) -> dict[str, Any]:
    """Read and check a baseline file.

    Raises:
        BaselineFileError: naming the file and what is wrong with it.
    """
    path = Path(path)
    if _is_checkpoint(path):
        raise BaselineFileError(
            f"{path}: a checkpoint, not a NumericalBaseline file: `lightning-determinism report {path}` describes the"
            " run a checkpoint holds"
        )
    if path.is_dir():
        raise BaselineFileError(f"{path}: is a directory, not a baseline file")
    if not path.is_file():
        raise BaselineFileError(f"{path}: no such file")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BaselineFileError(f"{path}: not a baseline file (not JSON: {err})") from None
    if isinstance(data, dict) and data.get("kind") == "divergence-probe":  # probe_file.KIND (not imported: a leaf)
        raise BaselineFileError(
            f"{path}: a DivergenceProbe file, not a NumericalBaseline one: `lightning-determinism diagnose A B` reads"
            " probe files"
        )
    version = data.get("format") if isinstance(data, dict) else None
    if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT:
        raise BaselineFileError(
            f"{path}: baseline format {version} was written by a newer lightning_determinism; this version reads"
            f" formats {', '.join(map(str, READABLE_FORMATS))}: upgrade it"
        )
    if version not in READABLE_FORMATS or not isinstance(data.get("steps"), list):
        raise BaselineFileError(
            f"{path}: not a baseline file (expected a NumericalBaseline JSON with 'format' in {list(READABLE_FORMATS)})"
        )
    for i, step in enumerate(data["steps"]):
        if not isinstance(step, dict) or "loss" not in step or "grad_norms" not in step:
            raise BaselineFileError(f"{path}: step entry {i} is malformed (needs 'loss' and 'grad_norms')")
    return data


def quantities(reference: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(name, reference value, current value)`` for every compared quantity of one step, in a fixed order."""
    # Per-parameter quantities before the global norm, so that a mismatch names the parameter it starts in.
    # A quantity whose ranks disagreed (``by_rank``: replicas that must be equal) is compared on each of them.
    by_rank = current.get("by_rank") or {}
    pairs: list[tuple[str, Any, Any]] = [("loss", reference.get("loss"), current.get("loss"))]
    for group in ("grad_norms", "param_norms"):
        ref_group, cur_group = reference.get(group, {}), current.get(group, {})
        for name in sorted(ref_group):
            key = f"{group}[{name}]"
            pairs.append((key, ref_group[name], cur_group.get(name)))
            pairs.extend((f"{key} on rank {r}", ref_group[name], v) for r, v in enumerate(by_rank.get(key, ())) if r)
    pairs.append(("grad_norm", reference.get("grad_norm"), current.get("grad_norm")))
    return pairs


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _same_nonfinite(x: Any, y: Any) -> bool:
    both_nan = isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y)
    return both_nan or (isinstance(x, float) and math.isinf(x) and x == y)


def differs(x: Any, y: Any, rtol: float, atol: float, nonfinite_equal: bool = False) -> bool:
    """Whether two recorded values disagree: beyond tolerance, missing on one side, or not finite.

    Examples:
        >>> differs(float("nan"), float("nan"), 1e-4, 1e-6), differs(float("nan"), float("nan"), 1e-4, 1e-6, True)
        (True, False)
    """
    if x is None or y is None:
        return x is not y
    if not (_finite(x) and _finite(y)):
        return not (nonfinite_equal and _same_nonfinite(x, y))
    return not math.isclose(x, y, rel_tol=rtol, abs_tol=atol)


def first_mismatch(
    reference: dict[str, Any], current: dict[str, Any], rtol: float, atol: float, nonfinite_equal: bool = False
) -> tuple[str, Any, Any] | None:
    """The first quantity of one step that differs: ``(name, reference value, current value)``, else None.

    Examples:
        >>> first_mismatch({"loss": 1.0}, {"loss": 1.1}, rtol=1e-4, atol=0.0)
        ('loss', 1.0, 1.1)
        >>> first_mismatch({"loss": float("nan")}, {"loss": float("nan")}, rtol=1e-4, atol=0.0)
        ('loss', nan, nan)
    """
    pairs = quantities(reference, current)
    return next(((n, x, y) for n, x, y in pairs if differs(x, y, rtol, atol, nonfinite_equal)), None)


def _abs_diff(a: float, b: float) -> float:
    if a == b:  # equal infinities included
        return 0.0
    return abs(a - b)  # nan or inf when either is not finite


def _rel(a: float, b: float) -> float:
    if a == b:
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.nan if math.isnan(a) or math.isnan(b) else math.inf
    scale = max(abs(a), abs(b))
    return abs(a - b) / scale if scale else math.inf


def _share(a: float, b: float, gap: float, rtol: float, atol: float) -> float:
    """``gap`` as a share of what ``math.isclose(a, b, rel_tol=rtol, abs_tol=atol)`` allows (above 1: it differs)."""
    if gap == 0 or math.isnan(gap):
        return gap
    allowed = max(rtol * max(abs(a), abs(b)), atol)
    return gap / allowed if allowed else math.inf


def _worst(current: float, new: float) -> float:
    """The larger difference, where NaN (an undefined difference) outranks everything."""
    if math.isnan(current) or math.isnan(new):
        return math.nan
    return max(current, new)


def _same_parameters(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether both steps hold bitwise the same parameters (digests, or format 1's fingerprints, on both sides)."""
    for key in ("param_digests", "param_fingerprints"):
        if key in a or key in b:
            return a.get(key) is not None and a.get(key) == b.get(key) and not b.get("by_rank")
    return False


def compare_baselines(
    a: dict[str, Any], b: dict[str, Any], rtol: float, atol: float, nonfinite_equal: bool = False
) -> dict[str, Any]:
    """Per-step maximum absolute and relative differences, non-finite values, and the first divergence.

    Returns:
        ``{"rows": [...], "first": {...} | None, "nonfinite": [{"step", "name", "a", "b"}, ...],
        "compared": int}``. A row's ``max_abs``/``max_rel`` is NaN when a value on either side is NaN; ``max_rel``
        (and ``max_rel_grad_norms``) leave out the pairs within ``atol`` of each other, which agree whatever their
        relative difference. ``max_tol``: the largest difference as a share of what the tolerance allows it,
        ``|a - b| / max(rtol * max(|a|, |b|), atol)`` (above 1: beyond tolerance, as :func:`differs` judges).

    Raises:
        BaselineFileError: if the files hold different steps or parameter sets.

    Examples:
        >>> s = {"step": 0, "loss": 1.0, "grad_norm": 1.0, "grad_norms": {"w": 1.0}, "param_norms": {"w": 2.0}}
        >>> out = compare_baselines({"steps": [s]}, {"steps": [{**s, "loss": 1.5}]}, rtol=1e-4, atol=0.0)
        >>> out["first"]["step"], out["first"]["name"]
        (0, 'loss')
    """
    from_a, from_b = a["steps"], b["steps"]
    if len(from_a) != len(from_b):
        raise BaselineFileError(f"the files hold different numbers of steps: {len(from_a)} and {len(from_b)}")
    rows: list[dict[str, Any]] = []
    first = None
    nonfinite: list[dict[str, Any]] = []
    compared = 0
    for step_a, step_b in zip(from_a, from_b, strict=True):
        names_a, names_b = set(step_a["grad_norms"]), set(step_b["grad_norms"])
        if names_a != names_b:
            only = sorted(names_a ^ names_b)
            raise BaselineFileError(f"the files hold different parameter sets at step {step_a.get('step')}: {only}")
        max_abs = max_rel = max_rel_grad = max_tol = 0.0
        for name, x, y in quantities(step_a, step_b):
            compared += 1
            if x is not None and y is not None:
                gap = _abs_diff(x, y)
                # The relative spread leaves out what `atol` excuses: two values near zero (a gradient that is
                # mathematically zero) are far apart relatively and still agree.
                rel = 0.0 if gap <= atol else _rel(x, y)
                max_abs, max_rel = _worst(max_abs, gap), _worst(max_rel, rel)
                max_tol = _worst(max_tol, _share(x, y, gap, rtol, atol))
                if name.startswith("grad_norms["):
                    max_rel_grad = _worst(max_rel_grad, rel)
                if not (_finite(x) and _finite(y)):
                    nonfinite.append({"step": step_a.get("step"), "name": name, "a": x, "b": y})
            if first is None and differs(x, y, rtol, atol, nonfinite_equal):
                diff = _abs_diff(x, y) if x is not None and y is not None else math.nan
                first = {"step": step_a.get("step"), "name": name, "a": x, "b": y, "diff": diff}
        rows.append(
            {
                "step": step_a.get("step"),
                "loss_a": step_a["loss"],
                "loss_b": step_b["loss"],
                "max_abs": max_abs,
                "max_rel": max_rel,
                "max_rel_grad_norms": max_rel_grad,
                "max_tol": max_tol,
                "bitwise_params": _same_parameters(step_a, step_b),
            }
        )
    return {"rows": rows, "first": first, "nonfinite": nonfinite, "compared": compared}


def describe_baseline(data: dict[str, Any]) -> dict[str, Any]:
    """What a baseline file says about the run that wrote it: world size, steps, quantities, the run and its report.

    Examples:
        >>> describe_baseline({"format": 1, "world_size": 2, "steps": []})["world_size"]
        2
    """
    steps = data.get("steps", [])
    first = steps[0] if steps else {}
    return {
        "kind": "NumericalBaseline file",
        "world_size": data.get("world_size"),
        "steps_recorded": len(steps),
        "parameters": len(first.get("grad_norms", {})),
        "quantities_per_step": len(quantities(first, first)) if first else 0,
        "run": data.get("run"),
        "report": data.get("report"),
    }


__all__ = [
    "DEFAULT_ATOL",
    "DEFAULT_RTOL",
    "FORMAT",
    "BaselineFileError",
    "compare_baselines",
    "describe_baseline",
    "differs",
    "first_mismatch",
    "load_baseline",
    "quantities",
]
