"""The ``lightning-determinism`` command: ``report`` a process, checkpoint or baseline; ``compare`` two baselines.

    lightning-determinism report [PATH] [--json]
    lightning-determinism compare A.json B.json [--plot out.png] [--rtol R] [--atol A] [--nonfinite-equal]

Exit status: 0 when the runs agree (``compare``) or the report was printed, 1 when they diverge, 2 on bad input —
with one line on stderr naming the argument and no traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from lightning_determinism.backends import determinism_report
from lightning_determinism.baseline_file import (
    DEFAULT_ATOL,
    DEFAULT_RTOL,
    BaselineFileError,
    compare_baselines,
    describe_baseline,
    load_baseline,
)

PROG = "lightning-determinism"


class _BadInput(Exception):
    """Anything the user gave that cannot be used: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage block and exit
        raise _BadInput(message)


def verdicts(report: dict[str, Any]) -> dict[str, str]:
    """A short judgement for each flag that can make a run nondeterministic.

    Examples:
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


def _print_flags(report: dict[str, Any]) -> None:
    judged = verdicts(report)
    width = max(len(key) for key in report)
    for key, value in report.items():
        note = judged.get(key, "")
        print(f"{key:<{width}}  {value!s:<24}  {note}".rstrip())
    bad = [k for k, v in judged.items() if v != "ok"]
    print(f"\n{len(bad)} setting(s) to look at" if bad else "\nnothing found that breaks reproducibility")


def describe_checkpoint(path: Path) -> dict[str, Any]:
    """What a Lightning checkpoint says about the run that wrote it (seeds, world size, position, flags).

    Raises:
        _BadInput: if the file cannot be read as a checkpoint.
    """
    import torch

    from lightning_determinism.callbacks.rng_checkpoint import CHECKPOINT_KEY

    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001  (any unpickling or I/O problem is the file's)
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise _BadInput(f"{path}: not a readable checkpoint ({first_line[:200]})") from None
    if not isinstance(checkpoint, dict):
        raise _BadInput(f"{path}: not a Lightning checkpoint (a {type(checkpoint).__name__}, not a dict)")
    saved = checkpoint.get(CHECKPOINT_KEY)
    description: dict[str, Any] = {
        "kind": "Lightning checkpoint",
        "lightning_version": checkpoint.get("pytorch-lightning_version"),
        "epoch": checkpoint.get("epoch"),
        "global_step": checkpoint.get("global_step"),
        "parameters": len(checkpoint.get("state_dict", {})),
        "optimizers": len(checkpoint.get("optimizer_states", [])),
        "lr_schedulers": len(checkpoint.get("lr_schedulers", [])),
    }
    if not isinstance(saved, dict):
        description["rng_state"] = "none (written without RNGStateCheckpoint: a resume is not bitwise)"
        return description
    ranks = saved.get("ranks") or []
    description.update(
        {
            "world_size": saved.get("world_size"),
            "base_seed": saved.get("base_seed"),
            "rng_state": f"{len(ranks)} rank(s): python, numpy, torch, CUDA, tracker, generators",
            "loader_generators": sorted((ranks[0].get("loaders") or {}) if ranks else {}),
            "report": saved.get("report"),
        }
    )
    return description


def _report(args: argparse.Namespace) -> int:
    if args.path is None:
        report = determinism_report()
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            _print_flags(report)
        return 0
    path = Path(args.path)
    if path.is_dir():
        raise _BadInput(f"{path}: is a directory, not a checkpoint or baseline file")
    if not path.is_file():
        raise _BadInput(f"{path}: no such file")
    description = describe_baseline(load_baseline(path)) if path.suffix == ".json" else describe_checkpoint(path)
    if args.json:
        print(json.dumps(description, indent=2))
        return 0
    recorded = description.pop("report", None)
    print(f"{path}: {description.pop('kind')}")
    width = max(len(key) for key in description)
    for key, value in description.items():
        print(f"  {key:<{width}}  {value}")
    if recorded:
        print("\nrecorded when it was written:")
        _print_flags(recorded)
    else:
        print("\nno determinism report recorded (written by an older version or without the package)")
    return 0


def _format_diff(value: float) -> str:
    return f"{value:>12.3e}" if math.isfinite(value) else f"{value!s:>12}"


def _compare(args: argparse.Namespace) -> int:
    if args.plot:
        from lightning_determinism._compare_plot import PlotError, check_plot_path

        try:
            check_plot_path(args.plot)  # before any work: a bad path must not cost a comparison
        except PlotError as err:
            raise _BadInput(str(err)) from None
    first_file, second_file = load_baseline(args.a), load_baseline(args.b)
    result = compare_baselines(first_file, second_file, args.rtol, args.atol, args.nonfinite_equal)
    print(f"{'step':>4}  {'loss A':>14}  {'loss B':>14}  {'max abs diff':>12}  {'max rel diff':>12}  bitwise params")
    for row in result["rows"]:
        print(
            f"{row['step']:>4}  {row['loss_a']:>14.8g}  {row['loss_b']:>14.8g}  {_format_diff(row['max_abs'])}"
            f"  {_format_diff(row['max_rel'])}  {'yes' if row['bitwise_params'] else 'no'}"
        )
    for entry in result["nonfinite"]:
        print(f"non-finite: step {entry['step']}, {entry['name']}: {entry['a']!r} in A, {entry['b']!r} in B")
    if args.plot:
        from lightning_determinism._compare_plot import draw

        draw(result, args.a, args.b, args.plot, args.rtol, args.atol)
        print(f"plot written to {args.plot}")
    first = result["first"]
    tolerance = f"rtol={args.rtol:g}, atol={args.atol:g}"
    if first is None:
        identical = all(r["max_abs"] == 0.0 and r["bitwise_params"] for r in result["rows"])
        steps = len(result["rows"])
        if identical and not result["nonfinite"]:
            print(f"bitwise identical: {steps} steps, {result['compared']} quantities")
        else:
            print(f"equal within {tolerance}: {steps} steps, {result['compared']} quantities")
        return 0
    why = (
        f"difference {first['diff']:.3e}; {tolerance}"
        if math.isfinite(first["diff"])
        else "a non-finite value is never equal; --nonfinite-equal accepts identical ones"
    )
    print(f"first divergence: step {first['step']}, {first['name']}: {first['a']!r} vs {first['b']!r} ({why})")
    return 1


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the command (``report`` and ``compare``); errors raise instead of exiting."""
    parser = _Parser(prog=PROG, description="Check and compare the reproducibility of runs.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    report = sub.add_parser(
        "report", help="the flags, versions and seeds in effect here, or recorded in a checkpoint or baseline file"
    )
    report.add_argument("path", nargs="?", help="a Lightning checkpoint or a NumericalBaseline JSON file")
    report.add_argument("--json", action="store_true", help="print the raw report as JSON")
    report.set_defaults(func=_report)
    compare = sub.add_parser("compare", help="compare two NumericalBaseline files; exit 1 when they differ")
    compare.add_argument("a", help="the reference baseline (JSON)")
    compare.add_argument("b", help="the baseline to check (JSON)")
    compare.add_argument("--plot", metavar="OUT.png", help="draw both loss curves and the per-step divergence")
    compare.add_argument("--rtol", type=_tolerance, default=DEFAULT_RTOL, help=f"relative tolerance ({DEFAULT_RTOL:g})")
    compare.add_argument("--atol", type=_tolerance, default=DEFAULT_ATOL, help=f"absolute tolerance ({DEFAULT_ATOL:g})")
    compare.add_argument(
        "--nonfinite-equal",
        action="store_true",
        help="count identical NaN/inf values in both files as equal (by default any NaN or inf is a divergence)",
    )
    compare.set_defaults(func=_compare)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status (0 equal/ok, 1 different, 2 bad input)."""
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args))
    except (_BadInput, BaselineFileError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
