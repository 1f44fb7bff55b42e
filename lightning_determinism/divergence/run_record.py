"""The determinism record's format: flat ``determinism/...`` keys, as loggers store them, and how two records differ.

:class:`~lightning_determinism.DeterminismRecord` (and :func:`~lightning_determinism.log_determinism_record` under
Fabric) logs the record through a logger's ``log_hyperparams``: one flat dict whose keys all start with
:data:`PREFIX`, so ``hparams.yaml`` (CSV, TensorBoard), TensorBoard's HParams tab, MLflow's parameters and W&B's
config all show them as they are. The model's fingerprint follows at each checkpoint save
(:func:`fingerprint_key`) and at the end of fit (:data:`FINAL_FINGERPRINT`). Here, beside the command that reads
them back (``lightning-determinism compare`` on two logger directories), so that the command imports no callback.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

PREFIX = "determinism/"
"""Every key of the record starts with it (the user's own hyperparameters never do, or are kept over ours)."""

FINGERPRINT_PREFIX = PREFIX + "fingerprint/"
FINAL_FINGERPRINT = FINGERPRINT_PREFIX + "final"
"""The key of the model's fingerprint at the end of fit."""

CHECKPOINT_KEY = "lightning_determinism_fingerprint"
"""The checkpoint key that holds ``{"fingerprint": str, "global_step": int}`` (loads under ``weights_only=True``)."""

_STEP = re.compile(r"step_(\d+)(?:\.(\d+))?$")


def fingerprint_key(step: int, repeat: int = 0) -> str:
    """The key of the model's fingerprint at a checkpoint saved after optimizer step ``step``.

    ``repeat`` numbers other weights saved at the same step (manual optimization that does not step).

    Examples:
        >>> fingerprint_key(4), fingerprint_key(4, repeat=1)
        ('determinism/fingerprint/step_4', 'determinism/fingerprint/step_4.1')
    """
    return f"{FINGERPRINT_PREFIX}step_{step}" + (f".{repeat}" if repeat else "")


def flat(record: Mapping[str, Any], prefix: str = PREFIX) -> dict[str, Any]:
    """A nested record as flat ``prefix + "a/b"`` keys with plain values (``None`` dropped, others kept).

    Examples:
        >>> flat({"seed": 3, "version": {"torch": "2.13.0"}, "mesh": None})
        {'determinism/seed': 3, 'determinism/version/torch': '2.13.0'}
    """
    out: dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, Mapping):
            out.update(flat(value, f"{prefix}{key}/"))
        elif value is not None:
            out[f"{prefix}{key}"] = value if isinstance(value, (bool, int, float, str)) else str(value)
    return out


def canonical(value: Any) -> Any:
    """A value as one logger or another gives it back: TensorBoard's numbers are floats, ``None`` a string.

    Examples:
        >>> canonical(42.0), canonical("None"), canonical(True), canonical(0.5)
        (42, None, True, 0.5)
    """
    if value is None or value == "None":
        return None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return value


def record_of(hparams: Mapping[str, Any]) -> dict[str, Any]:
    """The record's entries among a logger's hyperparameters, values made :func:`canonical`.

    Examples:
        >>> record_of({"lr": 0.1, "determinism/seed": 7.0})
        {'determinism/seed': 7}
    """
    return {str(k): canonical(v) for k, v in hparams.items() if str(k).startswith(PREFIX)}


def differences(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Every key whose value differs, or that only one record holds (``None`` for the missing side), sorted.

    Examples:
        >>> differences({"determinism/seed": 1, "determinism/x": 2}, {"determinism/seed": 1})
        {'determinism/x': (2, None)}
        >>> differences({"determinism/seed": 5, "determinism/flag": True}, {"determinism/seed": "5",
        ...              "determinism/flag": "True"})  # MLflow keeps parameters as text
        {}
    """
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if not _same(a.get(k), b.get(k))}


def _same(a: Any, b: Any) -> bool:
    """Equal as :func:`canonical` values, or as text where one logger keeps text (MLflow's ``"5"`` for ``5``)."""
    a, b = canonical(a), canonical(b)
    return a == b or (
        a is not None and b is not None and (isinstance(a, str) or isinstance(b, str)) and str(a) == str(b)
    )


# What a difference is called in one line, by the key's group, in the order the line names them.
_TOPICS = (
    ("seed", "seed"),
    ("seed_source", "how the seed was chosen"),
    ("seed_everything", "seed_everything's seed"),
    ("version/", "{} version"),
    ("debug_mode", "debug_mode"),
    ("backend/", "backend flag {}"),
    ("world_size", "world size"),
    ("mesh/", "device mesh"),
    ("topology/", "topology"),
    ("invariant/", "invariant mode (B/m/K)"),
    ("strategy", "strategy"),
    ("precision", "precision"),
    ("run/", "run {}"),
    ("rank_", "the ranks' random streams"),
    ("streams/", "the ranks' random streams"),
)


def _topic(key: str) -> tuple[int, str]:
    name = key[len(PREFIX) :]
    for order, (start, label) in enumerate(_TOPICS):
        if name == start or (start.endswith(("/", "_")) and name.startswith(start)):
            return order, label.format(name[len(start) :].split("/")[0]) if "{}" in label else label
    return len(_TOPICS), name


def differ_in(keys: list[str]) -> list[str]:
    """What the differing keys are about, one phrase each: ``["seed", "torch version", "fingerprint at step 4"]``.

    Examples:
        >>> differ_in(["determinism/version/torch", "determinism/seed", "determinism/rank_1/streams",
        ...            "determinism/fingerprint/step_2", "determinism/fingerprint/step_4", FINAL_FINGERPRINT])
        ['seed', 'torch version', "the ranks' random streams", 'fingerprint at steps 2, 4 and at the end']
    """
    topics: dict[str, int] = {}
    steps: list[str] = []
    final = False
    for key in keys:
        if key == FINAL_FINGERPRINT:
            final = True
        elif key.startswith(FINGERPRINT_PREFIX):
            match = _STEP.search(key)
            steps.append(match.group(1) if match else key[len(FINGERPRINT_PREFIX) :])
        else:
            order, label = _topic(key)
            topics.setdefault(label, order)
    out = sorted(topics, key=lambda label: topics[label])
    steps = sorted(set(steps), key=lambda s: (not s.isdigit(), int(s) if s.isdigit() else 0, s))
    if steps:
        where = f"step{'s' if len(steps) > 1 else ''} {', '.join(steps)}"
        out.append(f"fingerprint at {where}" + (" and at the end" if final else ""))
    elif final:
        out.append("fingerprint at the end")
    return out


def fingerprints(record: Mapping[str, Any]) -> dict[str, str]:
    """The record's fingerprints by where they were taken (``"step 4"``, ``"end"``), in the order of the run.

    Examples:
        >>> fingerprints({"determinism/fingerprint/step_10": "b", "determinism/fingerprint/step_2": "a",
        ...               FINAL_FINGERPRINT: "c"})
        {'step 2': 'a', 'step 10': 'b', 'end': 'c'}
    """
    steps = []
    for key, value in record.items():
        match = _STEP.search(key) if key.startswith(FINGERPRINT_PREFIX) else None
        if match:
            steps.append(((int(match.group(1)), int(match.group(2) or 0)), key, str(value)))
    out = {f"step {s[0]}" + (f".{s[1]}" if s[1] else ""): value for s, _, value in sorted(steps)}
    if FINAL_FINGERPRINT in record:
        out["end"] = str(record[FINAL_FINGERPRINT])
    return out


__all__ = [
    "CHECKPOINT_KEY",
    "FINAL_FINGERPRINT",
    "FINGERPRINT_PREFIX",
    "PREFIX",
    "canonical",
    "differ_in",
    "differences",
    "fingerprint_key",
    "fingerprints",
    "flat",
    "record_of",
]
