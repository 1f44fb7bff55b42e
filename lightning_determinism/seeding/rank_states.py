"""Every rank's RNG state in one checkpoint entry: gathering, validating and verifying it.

Shared by :class:`~lightning_determinism.RNGStateCheckpoint` (Trainer checkpoints) and
:class:`~lightning_determinism.strategies.fabric.FabricRNGState` (``fabric.save``/``fabric.load``). An entry holds, per
rank, :func:`~lightning_determinism.seeding.rng.capture_rng_state` and a sha256 digest of it, so a restore can check
that every rank got its own state back and that the ranks' equal/distinct pattern is the one that was saved.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch.distributed as dist

from lightning_determinism._process import distributed

CHECKPOINT_KEY = "lightning_determinism_rng"
"""The Lightning checkpoint key under which :class:`~lightning_determinism.RNGStateCheckpoint` writes its entry."""


def digest(rng: dict[str, Any]) -> str:
    """sha256 over the python, numpy and torch CPU states (what makes a rank's stream its own)."""
    h = hashlib.sha256()
    h.update(rng["python"]["state"].numpy().tobytes())
    h.update(rng["numpy"]["state"].numpy().tobytes())
    h.update(rng["torch"].numpy().tobytes())
    return h.hexdigest()


def pattern(digests: list[str]) -> list[list[int]]:
    """Groups of ranks holding equal states, e.g. ``[[0], [1]]`` (all distinct) or ``[[0, 1]]`` (all equal).

    Examples:
        >>> pattern(["a", "b", "a"])
        [[0, 2], [1]]
    """
    groups: dict[str, list[int]] = {}
    for rank, value in enumerate(digests):
        groups.setdefault(value, []).append(rank)
    return sorted(groups.values())


def all_gather(obj: Any) -> list[Any]:
    """``obj`` from every rank of the default process group (``[obj]`` without one)."""
    if distributed():
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def gather_to_zero(obj: Any) -> list[Any] | None:
    """``obj`` from every rank, on rank 0 only (``None`` elsewhere; ``[obj]`` without a process group).

    Per-sample records grow with the data, not with the ranks: rank 0 receives them once, where an all-gather would
    hand every rank everything (``W`` times the traffic).
    """
    if distributed():
        out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out
    return [obj]


def require(mapping: Any, key: str, where: str) -> Any:
    """``mapping[key]``, or ``ValueError`` naming the malformed checkpoint key."""
    if not isinstance(mapping, dict) or key not in mapping:
        raise ValueError(f"checkpoint key `{where}` is malformed: missing {key!r}")
    return mapping[key]


def check_ranks(saved: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """Validate an entry's ``world_size`` and per-rank ``rng``/``digest``; returns the ranks' entries."""
    ranks = require(saved, "ranks", where)
    world_size = require(saved, "world_size", where)
    if not isinstance(ranks, list) or len(ranks) != world_size:
        raise ValueError(f"checkpoint key `{where}.ranks` is malformed: expected {world_size} entries")
    for i, entry in enumerate(ranks):
        rng = require(entry, "rng", f"{where}.ranks[{i}]")
        for key in ("python", "numpy", "torch"):
            require(rng, key, f"{where}.ranks[{i}].rng")
        require(entry, "digest", f"{where}.ranks[{i}]")
    return ranks


def verify_restored(saved: dict[str, Any], rank: int, restored: str) -> None:
    """Collective: every rank holds the state saved for it, and the equal/distinct pattern is the saved one.

    Raises:
        RuntimeError: naming the ranks that hold another rank's or a foreign state.
    """
    digests = all_gather(restored)
    expected = [entry["digest"] for entry in saved["ranks"]]
    wrong = [r for r, (got, want) in enumerate(zip(digests, expected, strict=True)) if got != want]
    if wrong or pattern(digests) != pattern(expected):
        raise RuntimeError(
            f"[rank: {rank}] RNG states after resume do not match the checkpoint: ranks {wrong} hold another"
            f" rank's or a foreign state; saved equal-groups {pattern(expected)}, restored {pattern(digests)}"
        )


def other_seed_message(stored: Any, current: int | None) -> str | None:
    """The warning for a checkpoint written with another base seed, or ``None`` when the seeds agree."""
    if stored is None or stored < 0 or current is None or int(stored) == int(current):
        return None
    return (
        f"The checkpoint was written by a run with base seed {stored}, but this run's base seed is {current}: the"
        " RNG states saved in the checkpoint are restored, while everything derived from the base seed (worker"
        f" and per-sample seeds, the sampler's shuffle) follows {current}, so this is not the continuation of the"
        f" saved run. Resume with seed={stored} (or seed_everything({stored})) to continue it bitwise."
    )


__all__ = [
    "CHECKPOINT_KEY",
    "all_gather",
    "check_ranks",
    "digest",
    "gather_to_zero",
    "other_seed_message",
    "pattern",
    "require",
    "verify_restored",
]
