"""Divergences after the recorded steps: bisect two runs' checkpoints, replay the interval with the probe, diagnose it.

Both runs save a checkpoint every step (``ModelCheckpoint(every_n_train_steps=1, save_top_k=-1)``; the file names
carry ``step=N``, the ``trainer.global_step`` at saving). :func:`bisect_checkpoints` finds the last pair that is
equal by :func:`~lightning_determinism.fingerprint` (parameters, optimizer and scheduler states and every
rank's random states) and the first that is not, comparing the last pair first and then halving the interval: at most
``ceil(log2 n) + 1`` comparisons for ``n`` pairs. A divergence is permanent (once two runs' states differ, so do all
later ones), which is what makes the halving sound.

:func:`diagnose_checkpoints` then resumes each run from the last equal checkpoint (from the start when none is equal)
with a :class:`~lightning_determinism.DivergenceProbe` on the steps up to the first differing checkpoint, once per
run, through a function you give it, and returns :func:`~lightning_determinism.diagnose`'s answer. The replays are
bitwise replays of the original runs under the package's strategies (docs/resume.md).

A checkpoint is a ``.ckpt`` file, or Lightning's distributed checkpoint directory (``ModelParallelStrategy``,
``FSDPStrategy(state_dict_type="sharded")``: rank 0's ``meta.pt`` beside the shards), whose full weights and optimizer
states are read from the shards on this one process
(:func:`~lightning_determinism.checkpoints.distributed.load_distributed_checkpoint`). Both runs' checkpoints must be
of one kind: a directory's optimizer states are keyed by parameter name, a file's by index.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_determinism.checkpoints.distributed import check_distributed_checkpoint, load_distributed_checkpoint
from lightning_determinism.divergence.diagnosis.diagnose import diagnose
from lightning_determinism.divergence.diagnosis.probe import DivergenceProbe
from lightning_determinism.divergence.fingerprint import fingerprint, named_tensors
from lightning_determinism.seeding.rank_states import CHECKPOINT_KEY

_STEP = re.compile(r"(?:^|[^a-z_])step=(\d+)")


def checkpoint_steps(directory: str | Path) -> dict[int, Path]:
    """The checkpoints of a directory by the ``step=N`` in their names (``*.ckpt`` files or distributed directories).

    Raises:
        ValueError: for a directory that does not exist or holds no ``*.ckpt`` named with ``step=N``.

    Examples:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp())
        >>> for name in ("epoch=0-step=2.ckpt", "step=1.ckpt", "last.ckpt"):
        ...     _ = (d / name).write_bytes(b"")
        >>> {step: path.name for step, path in checkpoint_steps(d).items()}
        {1: 'step=1.ckpt', 2: 'epoch=0-step=2.ckpt'}
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"`{directory}` must be a directory of checkpoints, and it is not one")
    found: dict[int, Path] = {}
    for path in sorted(directory.glob("*.ckpt")):
        match = _STEP.search(path.stem)
        if match:
            found.setdefault(int(match.group(1)), path)
    if not found:
        raise ValueError(
            f"`{directory}` holds no checkpoint named with its step: expected files like 'step=3.ckpt'"
            " (ModelCheckpoint(every_n_train_steps=1, save_top_k=-1, filename='{step}'))"
        )
    return dict(sorted(found.items()))


def _determining(path: str | Path) -> dict[str, Any]:
    """What makes a run continue as it does from the checkpoint at ``path`` (a file or a distributed directory)."""
    if Path(path).is_dir():
        checkpoint = load_distributed_checkpoint(path)
    else:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    saved = checkpoint.get(CHECKPOINT_KEY) or {}
    return {
        "state_dict": checkpoint.get("state_dict", {}),
        "optimizer_states": checkpoint.get("optimizer_states", []),
        "lr_schedulers": checkpoint.get("lr_schedulers", []),
        "rng": [rank.get("rng") for rank in saved.get("ranks", []) if isinstance(rank, dict)],
    }


def checkpoint_fingerprint(path: str | Path) -> str:
    """The fingerprint of what makes a run continue as it does from a checkpoint.

    See :func:`~lightning_determinism.divergence.fingerprint.fingerprint`.
    Parameters, optimizer and LR-scheduler states and every rank's random states; not the hyperparameters, the
    callbacks' own state or the loop counters, which name the run rather than determine it. ``path`` is a ``.ckpt``
    file or a distributed checkpoint directory (its weights and optimizer states read whole from the shards).

    Raises:
        DamagedCheckpointError: for a distributed checkpoint directory without ``meta.pt`` or whose shards cannot be
            read.
    """
    return fingerprint(_determining(path))


def _entry_fingerprints(path: str | Path) -> dict[str, str]:
    """One fingerprint per entry (``state_dict.net.0.weight``, ``rng.1.torch``, ...): equal dicts, equal checkpoints.

    A rank's random states are one entry per generator (``python``, ``numpy``, ``torch``, ``cuda``, ``tracker``), not
    one per number of their states.
    """
    determining = _determining(path)
    ranks = determining.pop("rng")
    entries = {name: fingerprint(value) for name, value in named_tensors(determining).items()}
    for rank, state in enumerate(ranks):
        for kind, value in state.items() if isinstance(state, dict) else [(None, state)]:
            entries[f"rng.{rank}" if kind is None else f"rng.{rank}.{kind}"] = fingerprint(value)
    return entries


def _check_kinds(a: dict[int, Path], b: dict[int, Path], steps: list[int]) -> None:
    """Before any comparison: each pair is of one kind, and no distributed checkpoint lacks a file it needs."""
    for step in steps:
        if a[step].is_dir() != b[step].is_dir():
            kinds = [
                "a distributed checkpoint directory" if p.is_dir() else "a single-file checkpoint"
                for p in (a[step], b[step])
            ]
            raise ValueError(
                f"`{a[step]}` is {kinds[0]} and `{b[step]}` {kinds[1]}: bisect_checkpoints compares checkpoints of"
                " one kind (a directory's optimizer states are keyed by parameter name, a file's by index); save"
                " both runs with the same strategy and `save_distributed_checkpoint`"
            )
        for path in (a[step], b[step]):
            if path.is_dir():
                check_distributed_checkpoint(path)


@dataclass
class Bisection:
    """Where two runs' checkpoints part.

    Attributes:
        steps: the steps both directories hold a checkpoint of.
        last_equal: the step of the last equal pair; None when the first pair differs already.
        first_different: the step of the first differing pair; None when every pair is equal.
        comparisons: how many pairs were compared (at most ``ceil(log2 len(steps)) + 1``).
        checkpoints: the last equal pair's files (``{"a": path, "b": path}``), None where there is none.
        differences: what differs in the first differing pair, by name (``state_dict.net.0.weight``,
            ``optimizer_states.0.state...``, ``rng.1.torch`` for rank 1's torch RNG state); empty when all are equal.
    """

    steps: list[int]
    last_equal: int | None
    first_different: int | None
    comparisons: int
    checkpoints: dict[str, Path] | None
    differences: list[str] = field(default_factory=list)

    @property
    def limit(self) -> int:
        """``ceil(log2 n) + 1`` for ``n`` pairs: the most comparisons a bisection makes."""
        return math.ceil(math.log2(len(self.steps))) + 1 if self.steps else 0


def bisect_checkpoints(dir_a: str | Path, dir_b: str | Path) -> Bisection:
    """Find the first pair of checkpoints (same step) that differ by fingerprint, in ``ceil(log2 n) + 1`` comparisons.

    The checkpoints are ``.ckpt`` files or distributed checkpoint directories (``step=K.ckpt/`` with rank 0's
    ``meta.pt`` beside the shards), the same kind in both runs at each step.

    Raises:
        ValueError: for a directory without checkpoints, directories without a step in common, or a step whose
            checkpoint is a file in one run and a directory in the other.
        DamagedCheckpointError: for a distributed checkpoint directory without ``meta.pt`` or ``.metadata`` (checked
            before any comparison), or whose shards cannot be read.
    """
    a, b = checkpoint_steps(dir_a), checkpoint_steps(dir_b)
    steps = sorted(set(a) & set(b))
    if not steps:
        raise ValueError(f"`{dir_a}` and `{dir_b}` hold no checkpoint of the same step: {sorted(a)} and {sorted(b)}")
    _check_kinds(a, b, steps)
    compared = 0
    differing: dict[int, list[str]] = {}

    def equal(i: int) -> bool:
        nonlocal compared
        compared += 1
        entries_a, entries_b = _entry_fingerprints(a[steps[i]]), _entry_fingerprints(b[steps[i]])
        differing[i] = sorted(n for n in entries_a.keys() | entries_b.keys() if entries_a.get(n) != entries_b.get(n))
        return not differing[i]

    if equal(len(steps) - 1):
        last = steps[-1]
        return Bisection(steps, last, None, compared, {"a": a[last], "b": b[last]})
    lo, hi = -1, len(steps) - 1  # lo: equal (-1: before the first checkpoint), hi: differs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if equal(mid):
            lo = mid
        else:
            hi = mid
    last_equal = steps[lo] if lo >= 0 else None
    pair = {"a": a[steps[lo]], "b": b[steps[lo]]} if lo >= 0 else None
    return Bisection(steps, last_equal, steps[hi], compared, pair, differing[hi])


Replay = Callable[[str, "Path | None", DivergenceProbe], Any]
"""``replay(run, checkpoint, probe)``: continue run ``"a"`` or ``"b"`` from ``checkpoint`` (None: from the start) with
``probe`` among the Trainer's callbacks, up to ``max_steps=probe.steps[-1] + 1``."""


def diagnose_checkpoints(
    dir_a: str | Path, dir_b: str | Path, replay: Replay, out_dir: str | Path, modules: list[str] | None = None
) -> dict[str, Any]:
    """Bisect two runs' checkpoints, replay the interval where they part with the probe on, and diagnose it.

    Args:
        dir_a: run A's checkpoint directory.
        dir_b: run B's.
        replay: ``replay(run, checkpoint, probe)`` resumes run ``"a"`` or ``"b"`` from ``checkpoint`` (None: from the
            start) with ``probe`` among its callbacks and ``max_steps=probe.steps[-1] + 1``; called once per run.
        out_dir: where the two probe files go (``a.json``, ``b.json``).
        modules: the module paths to hook (None: every module).

    Returns:
        :func:`~lightning_determinism.diagnose`'s answer plus ``"bisection"`` (the :class:`Bisection` as a dict) and
        ``"replays"`` (runs replayed); ``{"verdict": "same", ...}`` without a replay when every pair is equal.
    """
    found = bisect_checkpoints(dir_a, dir_b)
    summary = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(found).items() if k != "checkpoints"}
    summary["limit"] = found.limit
    if found.first_different is None:
        return {"verdict": "same", "step": None, "micro_batch": None, "module": None, "phase": None, "cause": None,
                "bisection": summary, "replays": 0}  # fmt: skip
    start = found.last_equal if found.last_equal is not None else 0
    steps = list(range(start, found.first_different))
    out = Path(out_dir)
    paths = {}
    for run in ("a", "b"):
        paths[run] = out / f"{run}.json"
        checkpoint = found.checkpoints[run] if found.checkpoints else None
        replay(run, checkpoint, DivergenceProbe(paths[run], steps=steps, modules=modules))
    result = diagnose(paths["a"], paths["b"])
    result.update({"bisection": summary, "replays": 2})
    return result


__all__ = ["Bisection", "bisect_checkpoints", "checkpoint_fingerprint", "checkpoint_steps", "diagnose_checkpoints"]
