"""What ``lightning-determinism compare`` prints: two runs' per-step table, and the table of runs (numbers, then costs).

A leaf like :mod:`.baseline_file`: it formats what :func:`~lightning_determinism.divergence.baseline_runs.compare_runs`
and :func:`~lightning_determinism.divergence.baseline_file.compare_baselines` return.
"""

from __future__ import annotations

import math
from typing import Any


def _format_diff(value: float) -> str:
    return f"{value:>12.3e}" if math.isfinite(value) else f"{value!s:>12}"


def _loss_column(values: list[Any], width: int = 14) -> list[str]:
    """The losses of both runs in one notation and precision, right-aligned, so that their digits line up.

    Fixed-point with the decimals that give the largest value 9 significant digits, or scientific notation when the
    values span too many orders of magnitude for that.

    Examples:
        >>> _loss_column([0.6931471805599453, 12.5, float("nan")], width=12)
        ['   0.6931472', '  12.5000000', '         nan']
        >>> _loss_column([2.5e-07, 1.0], width=12)
        ['2.50000000e-07', '1.00000000e+00']
    """
    finite = [abs(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    largest = max(finite, default=0.0)
    smallest = min((v for v in finite if v), default=1.0)
    if largest < 1e7 and smallest >= 1e-3:
        spec = f".{max(9 - len(str(int(largest))), 1)}f"
    else:
        spec = ".8e"
    texts = [format(v, spec) if isinstance(v, (int, float)) and math.isfinite(v) else str(v) for v in values]
    width = max([width, *(len(t) for t in texts)])
    return [f"{t:>{width}}" for t in texts]


def _mebibytes(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.1f} MiB"


def _milliseconds(row: dict[str, Any]) -> str:
    value = row["comm_seconds_per_step"]
    steps = row["comm_steps"]
    return "-" if value is None else f"{value * 1e3:.3f} ms ({steps} step{'s' if steps != 1 else ''})"


def _numbers(row: dict[str, Any]) -> str:
    """A run's verdict in one cell: "reference", "within tolerance (max rel ...)" or where it first diverges."""
    first = row["first"]
    if row["verdict"] == "reference":
        return "reference"
    if first is None:
        spread = "bitwise" if row["bitwise"] else f"max rel {row['max_rel']:.1e}"
        return f"within tolerance ({spread})"
    return f"step {first['step']}, {first['name']}: {first['a']!r} vs {first['b']!r}"


_MEMORY_KINDS = {
    "cpu_peak_rss_of_process": "CPU: the process's peak RSS (a high-water mark since it started, not per step)",
    "cuda_max_allocated_per_step": "CUDA: torch.cuda.max_memory_allocated of each step",
}


def print_runs(table: dict[str, Any]) -> None:
    """The table of :func:`~lightning_determinism.divergence.baseline_runs.compare_runs`: numbers, then costs."""
    rows = table["runs"]
    names = [row["name"] for row in rows]
    cells = [_numbers(row) for row in rows]
    title = f"numbers against {names[0]}"
    wide, cell = max(len(n) for n in names), max(len(title), *(len(c) for c in cells))
    header = f"{'run':<{wide}}  {'ranks':>5}  {title:<{cell}}  {'peak memory':>12}  comm/step"
    print(header)
    for row, name, text in zip(rows, names, cells, strict=True):
        ranks = "?" if row["world_size"] is None else str(row["world_size"])
        print(
            f"{name:<{wide}}  {ranks:>5}  {text:<{cell}}  {_mebibytes(row['peak_memory_bytes']):>12}  "
            f"{_milliseconds(row)}"
        )
    kinds = sorted({row["memory"] for row in rows if row["memory"]})
    for kind in kinds:
        print(f"peak memory, {_MEMORY_KINDS.get(kind, kind)}")
    if any(row["comm_seconds_per_step"] is not None for row in rows):
        print(
            "comm/step: collectives' time (the backends' spans, profiled), the slowest rank's, mean over the profiled"
            " steps"
        )


def print_steps(result: dict[str, Any]) -> None:
    """Two runs' per-step table: both losses, the largest differences, whether the parameters are bitwise equal."""
    rows = result["rows"]
    losses = _loss_column([row["loss_a"] for row in rows] + [row["loss_b"] for row in rows])
    width = len(losses[0]) if losses else 14
    diffs = f"{'max abs diff':>12}  {'max rel diff':>12}"
    print(f"{'step':>4}  {'loss A':>{width}}  {'loss B':>{width}}  {diffs}  bitwise params")
    for row, loss_a, loss_b in zip(rows, losses[: len(rows)], losses[len(rows) :], strict=True):
        print(
            f"{row['step']:>4}  {loss_a}  {loss_b}  {_format_diff(row['max_abs'])}"
            f"  {_format_diff(row['max_rel'])}  {'yes' if row['bitwise_params'] else 'no'}"
        )


__all__ = ["print_runs", "print_steps"]
