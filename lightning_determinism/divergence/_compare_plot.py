"""The picture ``lightning-determinism compare --plot`` draws: the loss curves and the per-step divergence.

Two runs: both loss curves and the largest difference of any quantity per step. Three or more: every run's loss
curve and, per run, the largest difference of any quantity from the reference's per step as a share of the tolerance
(1: compare's limit), each run's first divergence ringed and named in its legend entry. Integer
steps, the tolerance drawn as a line, each run's first divergent step marked, non-finite values marked where they
occur, and "bitwise identical" written when the runs are.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any


class PlotError(ValueError):
    """The plot cannot be drawn where asked: the message names the path or the missing package."""


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError(
            "--plot needs matplotlib: pip install 'lightning-determinism[plot]'"
            " (in a source checkout: pip install -e '.[plot]')"
        ) from None
    return plt


def check_plot_path(path: str) -> None:
    """Refuse, before any work, a plot path that cannot be written or whose format matplotlib cannot draw.

    Raises:
        PlotError: naming the path and what is wrong with it.
    """
    _pyplot()
    from matplotlib.backend_bases import FigureCanvasBase

    target = Path(path)
    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    suffix = target.suffix.lower().lstrip(".")
    if target.is_dir():
        raise PlotError(f"--plot {path}: is a directory; give a file name such as {target / 'compare.png'}")
    if suffix not in formats:
        raise PlotError(
            f"--plot {path}: format {suffix or '(none)'!r} is not one matplotlib writes; use one of {formats}"
        )
    parent = target.parent if str(target.parent) else Path(".")
    if not parent.is_dir():
        raise PlotError(f"--plot {path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise PlotError(f"--plot {path}: the directory {parent} is not writable")


def draw(result: dict[str, Any], a: str, b: str, out: str, rtol: float, atol: float) -> None:
    """Draw the comparison ``result`` of files ``a`` and ``b`` into ``out``."""
    fig = make_figure(result, a, b, rtol, atol)
    fig.savefig(out)
    _pyplot().close(fig)


def make_figure(result: dict[str, Any], a: str, b: str, rtol: float, atol: float) -> Any:
    """The figure of :func:`draw`, not yet saved (tests look into it)."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    rows = result["rows"]
    steps = [row["step"] for row in rows]
    fig, (ax_loss, ax_diff) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    ax_loss.plot(steps, [row["loss_a"] for row in rows], "o-", label=a)
    ax_loss.plot(steps, [row["loss_b"] for row in rows], "x--", label=b)
    ax_loss.set_ylabel("loss")
    ax_loss.legend(fontsize="small")
    ax_diff.set_xlabel("step")
    ax_diff.set_ylabel("max difference over all quantities")
    ax_diff.xaxis.set_major_locator(MaxNLocator(integer=True))
    first = result["first"]
    bad_steps = sorted({entry["step"] for entry in result["nonfinite"]})
    identical = all(row["max_abs"] == 0.0 and row["bitwise_params"] for row in rows) and not bad_steps
    if identical:
        ax_diff.text(0.5, 0.5, "bitwise identical", ha="center", va="center", fontsize=16, transform=ax_diff.transAxes)
        ax_diff.set_yticks([])
    else:
        finite_rows = [r for r in rows if math.isfinite(r["max_abs"]) and math.isfinite(r["max_rel"])]
        positive = [v for r in finite_rows for v in (r["max_abs"], r["max_rel"]) if v > 0]
        floor = min([*positive, atol or 1.0, rtol or 1.0]) / 10
        for key, marker, label in (("max_rel", "s-", "relative"), ("max_abs", "^-", "absolute")):
            zero = any(r[key] == 0 for r in finite_rows)  # a log scale has no 0: say where it is drawn
            ax_diff.semilogy(
                [r["step"] for r in finite_rows],
                [max(r[key], floor) for r in finite_rows],
                marker,
                label=f"max {label} difference" + (f" (0 drawn at {floor:.0e})" if zero else ""),
            )
        if rtol > 0:
            ax_diff.axhline(rtol, color="tab:blue", linestyle=":", label=f"rtol = {rtol:g}")
        if atol > 0:
            ax_diff.axhline(atol, color="tab:orange", linestyle=":", label=f"atol = {atol:g}")
        for step in bad_steps:
            ax_diff.axvline(step, color="black", alpha=0.3, linewidth=6)
        if bad_steps:
            ax_diff.plot([], [], color="black", alpha=0.3, linewidth=6, label="NaN or inf at this step")
        ax_diff.legend(fontsize="x-small")
    if first is not None:
        for ax in (ax_loss, ax_diff):
            ax.axvline(first["step"], color="red", linestyle="--")
        right_half = steps and first["step"] > (steps[0] + steps[-1]) / 2  # the text turns left: never cut at the edge
        ax_loss.annotate(
            f"first divergence: step {first['step']}\n{first['name']}",
            xy=(first["step"], 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(-5 if right_half else 5, -5),
            textcoords="offset points",
            ha="right" if right_half else "left",
            va="top",
            color="red",
            fontsize="small",
        )
    fig.tight_layout()
    return fig


def draw_runs(table: dict[str, Any], comparisons: list[dict[str, Any]], out: str) -> None:
    """Draw the table of three or more runs (``compare_runs``, and its per-run ``comparisons``) into ``out``."""
    fig = make_runs_figure(table, comparisons)
    fig.savefig(out)
    _pyplot().close(fig)


def make_runs_figure(table: dict[str, Any], comparisons: list[dict[str, Any]]) -> Any:
    """The figure of :func:`draw_runs`, not yet saved: loss per step per run; every quantity's spread per run."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    rtol, atol = table["rtol"], table["atol"]
    rows = table["runs"]
    fig, (ax_loss, ax_diff) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    reference = comparisons[0]["rows"]
    steps = [row["step"] for row in reference]
    ax_loss.plot(steps, [row["loss_a"] for row in reference], "o-", label=f"{rows[0]['name']} (reference)")
    markers = ["x--", "s:", "^-.", "v--", "d:", "*-."]
    for i, (row, result) in enumerate(zip(rows[1:], comparisons, strict=True)):
        color = f"C{(i + 1) % 10}"  # the same colour for a run in both panels
        ax_loss.plot(
            steps, [r["loss_b"] for r in result["rows"]], markers[i % len(markers)], color=color, label=row["name"]
        )
    ax_loss.set_ylabel("loss")
    ax_loss.legend(fontsize="small")
    ax_diff.set_xlabel("step")
    # How far each run is from the reference as compare judges it: the largest difference of any quantity (loss,
    # gradient and parameter norms) as a share of the tolerance, 1 being the limit. A fault that leaves the gradients
    # alike at first (another learning rate changes the parameters, then the gradients) crosses 1 where it is found.
    key = "max_tol" if rtol or atol else "max_rel"  # no tolerance: the relative difference
    if key == "max_tol":
        ax_diff.set_ylabel("largest difference from the reference\nas a share of the tolerance (1: its limit)")
    else:
        ax_diff.set_ylabel("max relative difference from\nthe reference, every quantity")
    ax_diff.xaxis.set_major_locator(MaxNLocator(integer=True))
    values = [r.get(key, math.nan) for result in comparisons for r in result["rows"]]
    positive = [v for v in values if math.isfinite(v) and v > 0]
    floor = min([*positive, 1.0]) / 10
    if not positive:
        bitwise = all(r["max_abs"] == 0 and r["bitwise_params"] for result in comparisons for r in result["rows"])
        ax_diff.text(0.5, 0.75, "bitwise identical" if bitwise else "no difference drawn", ha="center", va="center",
                     fontsize=14, transform=ax_diff.transAxes)  # fmt: skip
    for i, (row, result) in enumerate(zip(rows[1:], comparisons, strict=True)):
        finite = [r for r in result["rows"] if math.isfinite(r.get(key, math.nan))]
        first = row["first"]
        # Where each run diverges goes in its legend entry (inside the axes: never cut at the figure's edge).
        label = row["name"] if first is None else f"{row['name']}: diverges at step {first['step']}, {first['name']}"
        line = ax_diff.semilogy(
            [r["step"] for r in finite],
            [max(r[key], floor) for r in finite],
            markers[i % len(markers)],
            color=f"C{(i + 1) % 10}",
            label=label,
        )[0]
        if first is not None:
            for ax in (ax_loss, ax_diff):
                ax.axvline(first["step"], color=line.get_color(), linestyle="--", alpha=0.7)
            at = [max(r[key], floor) for r in finite if r["step"] == first["step"]]
            if at:  # the first divergent step ringed on the run's own line
                ax_diff.plot([first["step"]], at, "o", markersize=12, markerfacecolor="none", color="red",
                             label="_first divergence")  # fmt: skip
    if key == "max_tol":
        ax_diff.axhline(1.0, color="tab:red", linestyle=":", label=f"the tolerance: rtol = {rtol:g}, atol = {atol:g}")
    zero = any(v == 0 for v in values)  # a log scale has no 0: say where it is drawn
    ax_diff.legend(fontsize="x-small", title=f"0 drawn at {floor:.0e}" if zero else None, title_fontsize="x-small")
    fig.tight_layout()
    return fig


__all__ = ["PlotError", "check_plot_path", "draw", "draw_runs", "make_figure", "make_runs_figure"]
