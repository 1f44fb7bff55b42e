"""Several baseline files side by side: each run against the first (the reference), then what each run cost.

The method's order: numbers first (each run's first step and quantity beyond tolerance against the reference, or
"within tolerance"), and only then peak memory and communication time, which mean nothing for a run that left the
reference. This module is a leaf, like :mod:`.baseline_file`: json and math, nothing of torch or Lightning.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from lightning_determinism.divergence.baseline_file import BaselineFileError, compare_baselines

WITHIN = "within tolerance"
"""A run's verdict when every compared quantity of every step is within tolerance of the reference."""


def run_costs(data: dict[str, Any]) -> dict[str, Any]:
    """What a recorded run cost: the largest peak memory of any rank and step, and communication per profiled step.

    Returns:
        ``{"peak_memory_bytes": int | None, "memory": str | None, "comm_seconds_per_step": float | None,
        "comm_steps": int}``: the communication time of a profiled step is its slowest rank's; the mean over the
        profiled steps. ``None`` where the file has no figure (format 1, or no profiled step).

    Examples:
        >>> steps = [{"peak_memory_bytes": [10, 12], "comm_seconds": [None, None]},
        ...          {"peak_memory_bytes": [11, 13], "comm_seconds": [0.002, 0.004]}]
        >>> run_costs({"run": {"memory": "cpu_peak_rss_of_process"}, "steps": steps})["comm_seconds_per_step"]
        0.004
    """
    peaks = [v for step in data.get("steps", []) for v in step.get("peak_memory_bytes") or [] if v is not None]
    comm = []
    for step in data.get("steps", []):
        measured = [v for v in step.get("comm_seconds") or [] if v is not None]
        if measured:
            comm.append(max(measured))
    return {
        "peak_memory_bytes": max(peaks) if peaks else None,
        "memory": (data.get("run") or {}).get("memory"),
        "comm_seconds_per_step": math.fsum(comm) / len(comm) if comm else None,
        "comm_steps": len(comm),
    }


def _describe(name: str, data: dict[str, Any]) -> dict[str, Any]:
    run = data.get("run") or {}
    return {
        "name": name,
        "world_size": data.get("world_size"),
        "strategy": run.get("strategy"),
        "mesh": run.get("mesh"),
        **run_costs(data),
    }


def compare_runs(
    runs: Sequence[tuple[str, dict[str, Any]]], rtol: float, atol: float, nonfinite_equal: bool = False
) -> dict[str, Any]:
    """Compare every run with the first: its first divergence (step and quantity) or "within tolerance", and its costs.

    Args:
        runs: ``(name, loaded baseline)`` pairs, two or more; the first is the reference.
        rtol: relative tolerance.
        atol: absolute tolerance.
        nonfinite_equal: count identical NaN/``inf`` values as equal.

    Returns:
        ``{"reference": name, "rtol", "atol", "runs": [row, ...], "diverged": int}``; a row has ``name``,
        ``verdict`` (``"reference"``, ``"within tolerance"`` or ``"diverges"``), ``first`` (``{"step", "name",
        "a", "b", "diff"}`` or ``None``), ``max_abs``/``max_rel`` over all steps, ``bitwise`` (every step's
        parameters), the run's ``world_size``, ``strategy``, ``mesh`` and its costs (:func:`run_costs`). The
        per-step comparisons are in ``"comparisons"`` (one per run after the first, for plots).

    Raises:
        BaselineFileError: fewer than two runs, or a run with other steps or parameters than the reference.

    Examples:
        >>> s = {"step": 0, "loss": 1.0, "grad_norm": 1.0, "grad_norms": {"w": 1.0}, "param_norms": {"w": 2.0}}
        >>> out = compare_runs([("a", {"steps": [s]}), ("b", {"steps": [{**s, "loss": 1.5}]})], 1e-4, 0.0)
        >>> [(row["name"], row["verdict"]) for row in out["runs"]], out["runs"][1]["first"]["name"]
        ([('a', 'reference'), ('b', 'diverges')], 'loss')
    """
    if len(runs) < 2:
        raise BaselineFileError(
            f"compare needs two or more baseline files (the first is the reference), got {len(runs)}"
        )
    (ref_name, reference), others = runs[0], runs[1:]
    rows = [{**_describe(ref_name, reference), "verdict": "reference", "first": None, "max_abs": 0.0, "max_rel": 0.0,
             "bitwise": True}]  # fmt: skip
    comparisons = []
    for name, data in others:
        try:
            result = compare_baselines(reference, data, rtol, atol, nonfinite_equal)
        except BaselineFileError as err:
            raise BaselineFileError(f"{name} against {ref_name}: {err}") from None
        comparisons.append(result)
        steps = result["rows"]
        rows.append(
            {
                **_describe(name, data),
                "verdict": WITHIN if result["first"] is None else "diverges",
                "first": result["first"],
                "max_abs": _worst(r["max_abs"] for r in steps),
                "max_rel": _worst(r["max_rel"] for r in steps),
                "bitwise": all(r["bitwise_params"] and r["max_abs"] == 0.0 for r in steps) and not result["nonfinite"],
                "nonfinite": result["nonfinite"],
            }
        )
    diverged = sum(row["verdict"] == "diverges" for row in rows)
    return {"reference": ref_name, "rtol": rtol, "atol": atol, "runs": rows, "diverged": diverged,
            "comparisons": comparisons}  # fmt: skip


def _worst(values: Any) -> float:
    out = 0.0
    for value in values:
        if math.isnan(value):
            return math.nan
        out = max(out, value)
    return out


__all__ = ["WITHIN", "compare_runs", "run_costs"]
