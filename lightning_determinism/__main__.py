"""``python -m lightning_determinism``: the ``lightning-determinism`` command.

See :mod:`lightning_determinism.divergence.cli`.
The same command as the console script; it starts more slowly, because ``-m`` imports the package (torch and
Lightning) before the command line is read.
"""

import sys

from lightning_determinism.divergence.cli import main

if __name__ == "__main__":
    sys.exit(main())
