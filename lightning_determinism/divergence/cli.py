"""The ``lightning-determinism`` command: ``report``, ``compare`` two baselines, ``diagnose`` two probe files.

    lightning-determinism report [PATH] [--json]
    lightning-determinism compare A.json B.json [C.json ...] [--plot out.png] [--json] [--rtol R] [--atol A]
                                  [--nonfinite-equal]
    lightning-determinism compare LOGDIR_A LOGDIR_B [...] [--json]       # the determinism records of two runs
    lightning-determinism diagnose A.json B.json [--json]

Exit status: 0 when the runs agree (``compare``, ``diagnose``) or the report was printed, 1 when they diverge, 2 on
bad input, with one line on stderr naming the argument and no traceback.

The command line is parsed by the light entry module ``_lightning_determinism_cli`` (standard library only);
:mod:`~lightning_determinism.divergence.commands` does the subcommands' work. This module puts the two together for
``python -m lightning_determinism``, ``python -m lightning_determinism.divergence.cli`` and
``from lightning_determinism.divergence.cli import main``.
"""

from __future__ import annotations

import sys

from _lightning_determinism_cli import PROG, build_parser, main
from lightning_determinism.divergence.commands import describe_checkpoint, run, verdicts

__all__ = ["PROG", "build_parser", "describe_checkpoint", "main", "run", "verdicts"]


if __name__ == "__main__":
    sys.exit(main())
