"""The entry point of the ``lightning-determinism`` command: reads the command line before importing anything heavy.

It lives outside the ``lightning_determinism`` package on purpose. Importing any module of the package first runs
``lightning_determinism/__init__.py``, which imports torch and Lightning (seconds) because importing the package
registers the deterministic strategies. ``--help`` and a bad argument are answered from here with the standard library
only, at once; :mod:`lightning_determinism.cli`, which does a subcommand's work, is imported once the arguments are
known to be good. ``python -m lightning_determinism`` runs the same :func:`main`, after the package's import.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from typing import NoReturn

PROG = "lightning-determinism"

# The values of lightning_determinism.baseline_file.DEFAULT_RTOL / DEFAULT_ATOL, which `compare` applies when the
# option is not given; written out here so that `--help` need not import the package (a test keeps them equal).
_DEFAULT_TOLERANCES = {"rtol": "0.0001", "atol": "1e-06"}


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
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    report = sub.add_parser(
        "report", help="the flags, versions and seeds in effect here, or recorded in a checkpoint or baseline file"
    )
    report.add_argument("path", nargs="?", help="a Lightning checkpoint or a NumericalBaseline JSON file")
    report.add_argument("--json", action="store_true", help="print the raw report as JSON")
    compare = sub.add_parser("compare", help="compare two NumericalBaseline files; exit 1 when they differ")
    compare.add_argument("a", help="the reference baseline (JSON)")
    compare.add_argument("b", help="the baseline to check (JSON)")
    compare.add_argument("--plot", metavar="OUT.png", help="draw both loss curves and the per-step divergence")
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
    diagnose.add_argument("a", help="run A's probe file (JSON written by DivergenceProbe)")
    diagnose.add_argument("b", help="run B's probe file")
    diagnose.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status (0 equal/ok, 1 different, 2 bad input)."""
    try:
        args = build_parser().parse_args(argv)
    except UsageError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    from lightning_determinism.cli import run  # torch and Lightning: only now that there is work to do

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
