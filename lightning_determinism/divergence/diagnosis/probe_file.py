"""DivergenceProbe files: the format, reading and checking them.

Written by :class:`~lightning_determinism.divergence.diagnosis.recorder.ProbeRecorder` (rank 0, after gathering every
rank's records; whole or not at all, by :func:`~lightning_determinism.checkpoints.atomic.write_atomically`), read by
:func:`~lightning_determinism.divergence.diagnosis.diagnose.diagnose` and the command line. JSON::

    {"format": 2, "kind": "divergence-probe", "world_size": W, "invariant": {"global_batch_size", "micro_batch_size"}
     or null, "modules": {path: type}, "parameters": {name: owner module path}, "report": determinism_report(),
     "steps": [{"step": s, "micro_batches_per_rank": K,
                "before": {"params": {name: rec}, "optimizers": [opt]}        # where a recorded window starts
                "micro_batches": [{"index": j, "rank": r, "pass": p, "scale": K, "scale_exact": bool,
                                   "data": digest, "samples": {"count", "sum"}, "rng": {stream: digest},
                                   "events": [event, ...], "step_end": {stream: digest}}],   # step_end: last pass
                "reduced": {name: rec}, "after": {"params": {name: rec}, "optimizers": [opt]}}]}

``rec`` is ``{"digest", "norm"}``; ``opt`` is ``{"digest", "groups": [hyperparameters]}``. Events, in the order they
happened on the rank: ``enter``/``exit`` of a module call (``module``, ``call``, ``input``/``output`` digest, ``rng``,
``from``: the calls whose outputs it took, ``parent``: the enclosing call, ``ops`` on exit), ``loss``, ``grad`` (the
gradient at a module call's output ``index``), ``param_grad`` (a parameter's gradient from this micro-batch, before
any reduction) and ``backward_end``. Backward digests are of gradients multiplied by the loss scale ``K`` (exact for a
power of two), so runs that accumulate differently line up. Micro-batch ``j = rank * K + pass``.

This module is a leaf: it knows json, nothing of torch or Lightning.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FORMAT = 2
"""The version of the probe file format written (2: tensors digested by position, on their device)."""
KIND = "divergence-probe"
"""The ``kind`` of a probe file (a NumericalBaseline file has none)."""


class ProbeFileError(ValueError):
    """A probe file is missing, unreadable or not a probe file: the message names the file and the problem."""


def load_probe(path: str | Path) -> dict[str, Any]:
    """Read and check a probe file.

    Raises:
        ProbeFileError: naming the file and what is wrong with it.

    Examples:
        >>> load_probe("missing.json")
        Traceback (most recent call last):
        ...
        lightning_determinism.divergence.diagnosis.probe_file.ProbeFileError: missing.json: no such file
    """
    path = Path(path)
    if path.is_dir():
        raise ProbeFileError(f"{path}: is a directory, not a probe file")
    if not path.is_file():
        raise ProbeFileError(f"{path}: no such file")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ProbeFileError(f"{path}: not a probe file (not JSON: {err})") from None
    if isinstance(data, dict) and data.get("kind") == KIND and data.get("format") != FORMAT:
        raise ProbeFileError(
            f"{path}: a probe file of format {data.get('format')!r}, this version reads format {FORMAT} (its digests"
            " are computed otherwise): record both runs with the same lightning_determinism version"
        )
    if not isinstance(data, dict) or data.get("kind") != KIND or data.get("format") != FORMAT:
        baseline = isinstance(data, dict) and "kind" not in data and isinstance(data.get("steps"), list)
        hint = " (a NumericalBaseline file? `lightning-determinism compare` reads those)" if baseline else ""
        raise ProbeFileError(
            f"{path}: not a probe file (expected a DivergenceProbe JSON with 'format': {FORMAT}){hint}"
        )
    steps = data.get("steps")
    if not isinstance(steps, list) or not steps:
        raise ProbeFileError(f"{path}: the probe recorded no step (the run ended before its first recorded step?)")
    for i, step in enumerate(steps):
        if not isinstance(step, dict) or not isinstance(step.get("micro_batches"), list) or "step" not in step:
            raise ProbeFileError(f"{path}: step entry {i} is malformed (needs 'step' and 'micro_batches')")
    if not isinstance(data.get("parameters"), dict):
        raise ProbeFileError(f"{path}: the 'parameters' entry is missing or malformed")
    return data


def describe_probe(data: dict[str, Any]) -> dict[str, Any]:
    """What a probe file says about the run that wrote it.

    Examples:
        >>> describe_probe({"world_size": 2, "steps": [{"step": 0, "micro_batches": []}]})["steps"]
        [0]
    """
    return {
        "kind": "DivergenceProbe file",
        "world_size": data.get("world_size"),
        "invariant": data.get("invariant"),
        "steps": [s.get("step") for s in data.get("steps", [])],
        "modules": len(data.get("modules") or {}),
        "parameters": len(data.get("parameters") or {}),
    }


__all__ = ["FORMAT", "KIND", "ProbeFileError", "describe_probe", "load_probe"]
