"""The ``lightning-determinism`` command: ``report`` the flags in effect, ``compare`` two baseline files.

    lightning-determinism report [--json]
    lightning-determinism compare A.json B.json [--plot out.png] [--rtol R] [--atol A]

``compare`` exits 0 when the files agree within tolerance, 1 when they do not (usable in CI), 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from lightning_determinism.backends import determinism_report
from lightning_determinism.baseline_file import BaselineFileError, compare_baselines, load_baseline
from lightning_determinism.callbacks.baseline import DEFAULT_ATOL, DEFAULT_RTOL

PROG = "lightning-determinism"


def verdicts(report: dict[str, Any]) -> dict[str, str]:
    """A short judgement for each flag that can make a run nondeterministic.

    Example:
        >>> verdicts({"cudnn_benchmark": True})["cudnn_benchmark"]
        'nondeterministic: cuDNN benchmark is on'
    """
    out = {}
    cuda = bool(report.get("cuda_available"))
    if "deterministic_algorithms" in report:
        out["deterministic_algorithms"] = (
            "ok" if report["deterministic_algorithms"] else "nondeterministic: deterministic algorithms are off"
        )
    if report.get("cudnn_benchmark"):
        out["cudnn_benchmark"] = "nondeterministic: cuDNN benchmark is on"
    elif "cudnn_benchmark" in report:
        out["cudnn_benchmark"] = "ok"
    if cuda and not report.get("cudnn_deterministic"):
        out["cudnn_deterministic"] = "nondeterministic: cuDNN may pick nondeterministic kernels"
    for key in ("cuda_matmul_allow_tf32", "cudnn_allow_tf32"):
        if report.get(key) and cuda:
            out[key] = "differs from float32: TF32 rounds matmul inputs to 10 bits"
    if cuda and report.get("cublas_workspace_config") not in (":4096:8", ":16:8"):
        out["cublas_workspace_config"] = "nondeterministic: cuBLAS needs CUBLAS_WORKSPACE_CONFIG=:4096:8"
    if report.get("base_seed") is None and report.get("pl_global_seed") is None:
        out["base_seed"] = "unseeded: neither set_seed, a deterministic strategy nor seed_everything ran"
    return out


def _report(args: argparse.Namespace) -> int:
    report = determinism_report()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    judged = verdicts(report)
    width = max(len(key) for key in report)
    for key, value in report.items():
        note = judged.get(key, "")
        print(f"{key:<{width}}  {value!s:<24}  {note}".rstrip())
    bad = [k for k, v in judged.items() if v != "ok"]
    print(f"\n{len(bad)} setting(s) to look at" if bad else "\nnothing found that breaks reproducibility")
    return 0


def _plot(result: dict[str, Any], a: str, b: str, out: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BaselineFileError("--plot needs matplotlib: pip install 'lightning-determinism[plot]'") from None
    rows = result["rows"]
    steps = [row["step"] for row in rows]
    fig, (ax_loss, ax_diff) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    ax_loss.plot(steps, [row["loss_a"] for row in rows], "o-", label=a)
    ax_loss.plot(steps, [row["loss_b"] for row in rows], "x--", label=b)
    ax_loss.set_ylabel("loss")
    ax_loss.legend(fontsize="small")
    floor = 1e-18  # bitwise-equal steps would vanish from a log scale
    ax_diff.semilogy(steps, [max(row["max_rel"], floor) for row in rows], "s-", label="max relative difference")
    ax_diff.semilogy(steps, [max(row["max_abs"], floor) for row in rows], "^-", label="max absolute difference")
    ax_diff.set_xlabel("step")
    ax_diff.set_ylabel("divergence")
    ax_diff.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def _compare(args: argparse.Namespace) -> int:
    first_file, second_file = load_baseline(args.a), load_baseline(args.b)
    result = compare_baselines(first_file, second_file, rtol=args.rtol, atol=args.atol)
    print(f"{'step':>4}  {'loss A':>14}  {'loss B':>14}  {'max abs diff':>12}  {'max rel diff':>12}  bitwise params")
    for row in result["rows"]:
        print(
            f"{row['step']:>4}  {row['loss_a']:>14.8g}  {row['loss_b']:>14.8g}  {row['max_abs']:>12.3e}"
            f"  {row['max_rel']:>12.3e}  {'yes' if row['bitwise_params'] else 'no'}"
        )
    if args.plot:
        _plot(result, args.a, args.b, args.plot)
        print(f"plot written to {args.plot}")
    first = result["first"]
    if first is None:
        print(f"equal within rtol={args.rtol:g}, atol={args.atol:g}")
        return 0
    print(
        f"first divergence: step {first['step']}, {first['name']}: {first['a']!r} vs {first['b']!r}"
        f" (difference {first['diff']:.3e}; rtol={args.rtol:g}, atol={args.atol:g})"
    )
    return 1


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the command (``report`` and ``compare``)."""
    parser = argparse.ArgumentParser(prog=PROG, description="Check and compare the reproducibility of runs.")
    sub = parser.add_subparsers(dest="command", required=True)
    report = sub.add_parser("report", help="the flags, versions and seeds in effect, with a verdict per flag")
    report.add_argument("--json", action="store_true", help="print the raw report as JSON")
    report.set_defaults(func=_report)
    compare = sub.add_parser("compare", help="compare two NumericalBaseline files; exit 1 when they differ")
    compare.add_argument("a", help="the reference baseline (JSON)")
    compare.add_argument("b", help="the baseline to check (JSON)")
    compare.add_argument("--plot", metavar="OUT.png", help="draw both loss curves and the per-step divergence")
    compare.add_argument("--rtol", type=float, default=DEFAULT_RTOL, help=f"relative tolerance ({DEFAULT_RTOL:g})")
    compare.add_argument("--atol", type=float, default=DEFAULT_ATOL, help=f"absolute tolerance ({DEFAULT_ATOL:g})")
    compare.set_defaults(func=_compare)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status (0 equal/ok, 1 different, 2 bad input)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except BaselineFileError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
