"""The seeds the package last seeded this process with, published in the environment (a leaf of ``seeding``).

Set by :func:`~lightning_determinism.set_seed` and the strategies; read by the backends' report, the checkpoints and
the data-loader workers (which inherit the environment). Here, below both ``seeds`` and ``backends``, so neither
imports the other for it.
"""

from __future__ import annotations

import os

BASE_SEED_ENV = "LDET_BASE_SEED"
"""Environment variable that carries the base seed to data-loader workers and child processes."""

LOCAL_SEED_ENV = "LDET_LOCAL_SEED"
"""Environment variable that carries this process's ``base + rank`` seed."""


def _record_seeds(base: int, local: int) -> None:
    """Publish the seeds in effect for children, workers and :func:`determinism_report`."""
    os.environ[BASE_SEED_ENV] = str(base)
    os.environ[LOCAL_SEED_ENV] = str(local)


def current_seeds() -> dict[str, int | None]:
    """The base and local seeds this process was last seeded with by the package (``None`` if never).

    Examples:
        >>> _record_seeds(5, 6)
        >>> current_seeds()
        {'base_seed': 5, 'local_seed': 6}
    """
    base = os.environ.get(BASE_SEED_ENV)
    local = os.environ.get(LOCAL_SEED_ENV)
    return {"base_seed": None if base is None else int(base), "local_seed": None if local is None else int(local)}


__all__ = ["BASE_SEED_ENV", "LOCAL_SEED_ENV", "current_seeds"]
