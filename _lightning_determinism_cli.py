"""The entry point of the ``lightning-determinism`` command: reads the command line before importing anything heavy.

It lives outside the ``lightning_determinism`` package on purpose. Importing any module of the package first runs
``lightning_determinism/__init__.py``, which imports torch and Lightning (seconds) because importing the package
registers the deterministic strategies. ``--help``, a bad argument and an input file that is missing or unreadable
are answered from here with the standard library only, at once; :mod:`lightning_determinism.divergence.commands`,
which does a subcommand's work, is imported once the arguments are known to be good. ``python -m
lightning_determinism`` runs the same :func:`main`, after the package's import.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

PROG = "lightning-determinism"

# The values of lightning_determinism.divergence.baseline_file.DEFAULT_RTOL / DEFAULT_ATOL, which `compare` applies when
# the option is not given; written out here so that `--help` need not import the package (a test keeps them equal).
_DEFAULT_TOLERANCES = {"rtol": "0.0001", "atol": "1e-06"}


def _version() -> str:
    """The installed package's version, read without importing it (torch and Lightning)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lightning-determinism")
    except PackageNotFoundError:  # pragma: no cover  (run from a checkout that was never installed)
        return "unknown (not installed)"


class UsageError(Exception):
    """A command line that cannot be used: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage block and exit
        raise UsageError(message)


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the command (``report``, ``compare``, ``diagnose``); errors raise :class:`UsageError`.

    Examples:
        >>> build_parser().parse_args(["compare", "a.json", "b.json", "--rtol", "0"]).rtol
        0.0
    """
    parser = _Parser(prog=PROG, description="Check and compare the reproducibility of runs.")
    parser.add_argument("--version", action="version", version=f"{PROG} {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    report = sub.add_parser(
        "report",
        help="the flags, versions and seeds in effect here, or recorded in a checkpoint, a baseline file or a logger's"
        " directory",
    )
    report.add_argument(
        "path",
        nargs="?",
        help="a Lightning checkpoint, a NumericalBaseline JSON file, or a logger's output directory (CSV, TensorBoard)",
    )
    report.add_argument("--json", action="store_true", help="print the raw report as JSON")
    compare = sub.add_parser(
        "compare",
        help="compare two or more NumericalBaseline files, or loggers' directories, with the first; exit 1 when any"
        " differs",
        description="Each run against the first (the reference): its first step and quantity beyond tolerance, or"
        " 'within tolerance'; then its peak memory and communication time. Given loggers' output directories (CSV,"
        " TensorBoard), the runs' determinism records: seeds, versions, flags, fingerprints, and what differs; where"
        " both directories hold per-sample records of an evaluation (SampleRecord), which samples differ and why.",
    )
    compare.add_argument(
        "files",
        nargs="+",
        metavar="FILE",
        help="baselines (JSON), loggers' output directories or per-sample records; the first is the reference",
    )
    compare.add_argument("--plot", metavar="OUT.png", help="draw the loss curves and the per-step divergence")
    compare.add_argument("--json", action="store_true", help="print the table as one JSON object")
    for name, what in (("rtol", "relative"), ("atol", "absolute")):
        compare.add_argument(
            f"--{name}", type=_tolerance, help=f"{what} tolerance (default: {_DEFAULT_TOLERANCES[name]})"
        )
    compare.add_argument(
        "--nonfinite-equal",
        action="store_true",
        help="count identical NaN/inf values in both files as equal (by default any NaN or inf is a divergence)",
    )
    diagnose = sub.add_parser(
        "diagnose",
        help="where and why two runs diverge, from two DivergenceProbe files; exit 1 when they diverge",
        description="Name the first step, micro-batch, module and phase whose output differs while its inputs"
        " matched, and the cause: data, randomness, kernel, reduction or optimizer.",
    )
    diagnose.add_argument(
        "a",
        help="run A's probe file (JSON written by DivergenceProbe), or its per-sample record"
        " (determinism_samples_<stage>.json, written by SampleRecord)",
    )
    diagnose.add_argument("b", help="run B's probe file")
    diagnose.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return parser


# The input files of each subcommand, and what each should be (for the message when it is a directory).
_INPUTS = {
    "report": (("path", "checkpoint or baseline file"),),
    "compare": (("files", "baseline file"),),
    "diagnose": (("a", "probe file"), ("b", "probe file")),
}


# The inputs that may also be a logger's output directory (the determinism record, docs/record.md), and its files.
_OR_LOGS = ("checkpoint or baseline file", "baseline file")
_LOG_FILES = "hparams.yaml, TensorBoard event file, MLflow run or W&B run file"


def _holds_logs(path: str, depth: int = 3) -> bool:
    """Whether ``path`` or a directory up to ``depth`` levels below holds a logger's files (the standard library)."""
    try:
        entries = list(os.scandir(path))
    except OSError:
        return False
    files = {e.name for e in entries if e.is_file()}
    if "hparams.yaml" in files or any(n.startswith("events.out.tfevents.") or n.endswith(".wandb") for n in files):
        return True
    if "meta.yaml" in files and any(e.name == "params" and e.is_dir() for e in entries):  # an MLflow file store run
        return True
    return depth > 0 and any(_holds_logs(e.path, depth - 1) for e in entries if e.is_dir(follow_symlinks=False))


def _unusable_input(path: str, kind: str) -> str | None:
    """Why ``path`` cannot be read as an input file of the given ``kind``, or None when it can.

    Examples:
        >>> _unusable_input("missing.json", "baseline file")
        'missing.json: no such file'
        >>> _unusable_input(".", "probe file")
        '.: is a directory, not a probe file'
    """
    if kind in _OR_LOGS and path.startswith("runs:/"):
        return None  # an MLflow run: read with MLflow's client by the subcommand
    if os.path.isdir(path):
        if kind.startswith("checkpoint") and os.path.isfile(os.path.join(path, "meta.pt")):
            return None  # Lightning's distributed checkpoint (ModelParallelStrategy, FSDP): a directory
        if kind.startswith("baseline") and any(os.path.isfile(os.path.join(path, f)) for f in ("meta.pt", ".metadata")):
            return (
                f"{path}: a checkpoint, not a NumericalBaseline file: `lightning-determinism report {path}` describes"
                " the run a checkpoint holds"
            )
        if kind in _OR_LOGS:
            if _holds_logs(path):
                return None  # a logger's output directory (CSV, TensorBoard): its record is read by the subcommand
            return f"{path}: is a directory, not a {kind} (nor a logger's directory: no {_LOG_FILES} in it or below)"
        return f"{path}: is a directory, not a {kind}"
    if not os.path.exists(path):
        return f"{path}: no such file"
    if not os.path.isfile(path):  # a FIFO or device: opening it could block
        return f"{path}: not a regular file (expected a {kind})"
    try:
        with open(path, "rb"):
            pass
    except OSError as err:
        return f"{path}: cannot be read ({err.strerror or type(err).__name__})"
    return None


def check_inputs(args: argparse.Namespace) -> None:
    """Refuse, before torch is imported, an input file that is missing, a directory or unreadable.

    The output path of ``--plot`` is checked for its directory here too; whether matplotlib can write its format is
    checked by the subcommand (that needs matplotlib).

    Raises:
        UsageError: naming the first file that cannot be used and why.

    Examples:
        >>> check_inputs(build_parser().parse_args(["compare", "a.json", "missing.json"]))
        Traceback (most recent call last):
        ...
        _lightning_determinism_cli.UsageError: a.json: no such file
    """
    if args.command == "compare" and len(args.files) < 2:
        raise UsageError(
            f"compare needs two or more baseline files (the first is the reference), got {len(args.files)}"
        )
    for name, kind in _INPUTS[args.command]:
        given = getattr(args, name)
        for path in given if isinstance(given, list) else [given]:
            problem = None if path is None else _unusable_input(path, kind)
            if problem:
                raise UsageError(problem)
    plot = getattr(args, "plot", None)
    if plot:
        parent = os.path.dirname(plot) or "."
        if os.path.isdir(plot):
            raise UsageError(
                f"--plot {plot}: is a directory; give a file name such as {os.path.join(plot, 'compare.png')}"
            )
        if not os.path.isdir(parent):
            raise UsageError(f"--plot {plot}: the directory {parent} does not exist")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status (0 equal/ok, 1 different, 2 bad input)."""
    try:
        args = build_parser().parse_args(argv)
        check_inputs(args)
    except UsageError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    from lightning_determinism.divergence.commands import run  # torch and Lightning: only now that there is work

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
