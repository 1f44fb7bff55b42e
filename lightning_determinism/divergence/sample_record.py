"""The per-sample record of an evaluation: each sample's result and the batch it was evaluated in, and what two say.

:class:`~lightning_determinism.callbacks.sample_record.SampleRecord` writes ``determinism_samples_<stage>.json``
beside the logger's files. ``compare`` (given the loggers' directories or the files) and ``diagnose`` (given the
files) read two of them and say which samples differ, and why where the records can tell:

- every differing sample was evaluated in another batch (other companions, another size, another position or rank)
  and batch-invariant evaluation was off in both runs: the **batch composition** (the kernels pick their path by
  shape);
- the mode was on in one run only: the mode itself (its fixed tiles give other last bits than the stock kernels);
- batch-invariant evaluation was on in both runs, or a differing sample had the same batch in both: not the batch
  composition, but the weights, the data or a kernel outside the mode's cover.

The format (one JSON object): ``kind``, ``format``, ``stage``, ``epoch``, ``step``, ``world_size``,
``batch_invariant``, ``batches`` (``[rank, dataloader, batch, [indices]]`` in the order each rank ran them) and
``samples`` (``"<dataloader>/<index>"`` -> ``[result, batch number]``; the result is a float's hex form for one number,
else ``dtype shape sha256``). A leaf: imports nothing of the package.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

KIND = "lightning_determinism.samples"
FORMAT = 1
FILE_PATTERN = "determinism_samples_{stage}.json"
FILE_GLOB = "determinism_samples_*.json"
_SHOWN = 5  # differing samples named in the text


class SampleRecordError(ValueError):
    """A file that is not a per-sample record (or one of another format)."""


def samples_file(directory: str | Path, stage: str) -> Path:
    """Where a run's record of ``stage`` lives in a logger's directory.

    Examples:
        >>> samples_file("logs/version_0", "validate").as_posix()
        'logs/version_0/determinism_samples_validate.json'
    """
    return Path(directory) / FILE_PATTERN.format(stage=stage)


def is_sample_record(path: str | Path) -> bool:
    """Whether ``path`` is a per-sample record file (by its name and first bytes)."""
    path = Path(path)
    if not path.is_file() or not path.name.startswith("determinism_samples_"):
        return False
    try:
        with path.open("rb") as file:  # the kind is near the start: a record of a million samples is not read
            return f'"kind": "{KIND}"'.encode() in file.read(200)
    except OSError:
        return False


def records_in(directory: str | Path) -> dict[str, Path]:
    """The per-sample records in a logger's directory, by stage (none for a file or an MLflow run)."""
    directory = Path(directory)
    if not directory.is_dir():
        return {}
    return {path.stem[len("determinism_samples_") :]: path for path in sorted(directory.glob(FILE_GLOB))}


def load_samples(path: str | Path) -> dict[str, Any]:
    """Read and check a per-sample record.

    Raises:
        SampleRecordError: naming the file and what is wrong with it.

    Examples:
        >>> load_samples("missing.json")
        Traceback (most recent call last):
        ...
        lightning_determinism.divergence.sample_record.SampleRecordError: missing.json: no such file
    """
    path = Path(path)
    if not path.is_file():
        raise SampleRecordError(f"{path}: no such file")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SampleRecordError(f"{path}: not a per-sample record (not JSON: {err})") from None
    if not isinstance(data, dict) or data.get("kind") != KIND:
        raise SampleRecordError(f"{path}: not a per-sample record (written by SampleRecord)")
    if data.get("format") != FORMAT:
        raise SampleRecordError(
            f"{path}: a per-sample record of format {data.get('format')!r}, this version reads {FORMAT}"
        )
    return data


def _batch_of(record: dict[str, Any], number: int) -> dict[str, Any]:
    rank, loader, batch, indices = record["batches"][number]
    return {"rank": rank, "dataloader": loader, "batch": batch, "indices": indices}


def _composition(record: dict[str, Any], key: str) -> tuple[int, tuple[int, ...], int]:
    """(rank, the batch's indices, the sample's position): what decides the kernels' shapes around a sample."""
    batch = _batch_of(record, record["samples"][key][1])
    index = int(key.split("/")[1])
    return batch["rank"], tuple(batch["indices"]), batch["indices"].index(index)


def compare_samples(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Which samples two per-sample records disagree on, and the cause where the records name one.

    Examples:
        >>> one = {"batch_invariant": False, "world_size": 1, "batches": [[0, 0, 0, [0, 1]]],
        ...        "samples": {"0/0": ["0x1.0p+0", 0], "0/1": ["0x1.8p+0", 0]}}
        >>> two = {"batch_invariant": False, "world_size": 2, "batches": [[0, 0, 0, [0]], [1, 0, 0, [1]]],
        ...        "samples": {"0/0": ["0x1.0p+0", 0], "0/1": ["0x1.9p+0", 1]}}
        >>> result = compare_samples(one, two)
        >>> result["differing"], result["cause"]
        (['0/1'], 'batch composition')
    """
    keys_a, keys_b = set(a["samples"]), set(b["samples"])
    common = sorted(keys_a & keys_b, key=lambda key: tuple(int(part) for part in key.split("/")))
    differing = [key for key in common if a["samples"][key][0] != b["samples"][key][0]]
    moved = [key for key in differing if _composition(a, key) != _composition(b, key)]
    both_on = bool(a.get("batch_invariant")) and bool(b.get("batch_invariant"))
    result: dict[str, Any] = {
        "compared": len(common),
        "differing": differing,
        "only_in_a": sorted(keys_a - keys_b),
        "only_in_b": sorted(keys_b - keys_a),
        "batch_invariant": [bool(a.get("batch_invariant")), bool(b.get("batch_invariant"))],
        "cause": None,
        "explanation": "",
        "examples": [
            {
                "sample": key,
                "a": a["samples"][key][0],
                "b": b["samples"][key][0],
                "batch_a": _batch_of(a, a["samples"][key][1]),
                "batch_b": _batch_of(b, b["samples"][key][1]),
            }
            for key in differing[:_SHOWN]
        ],  # fmt: skip
    }
    if not differing:
        return result
    if bool(a.get("batch_invariant")) != bool(b.get("batch_invariant")):
        result["cause"] = "batch-invariant evaluation in one run only"
        result["explanation"] = (
            "the mode computes every product in tiles of a fixed row count, which gives other last bits than the"
            " stock kernels for every sample by design: compare evaluations with the same `batch_invariant` setting"
        )
    elif moved == differing and not both_on:
        result["cause"] = "batch composition"
        result["explanation"] = (
            f"every differing sample was evaluated in another batch (world size {a.get('world_size')} vs"
            f" {b.get('world_size')}), and batch-invariant evaluation was off in both runs: a sample's"
            " bits depend on the shape of its batch (kernels pick their path by the row count; padding changes the"
            " attention's blocks). Evaluate with batch_invariant=True on the strategy (docs/batch-invariance.md)"
        )
    elif both_on:
        result["cause"] = "not the batch composition"
        result["explanation"] = (
            "batch-invariant evaluation was on in both runs, which rules out the batch composition: compare the"
            " evaluated weights (fingerprint/final), the data, or a kernel outside the mode's cover"
        )
    else:
        same = len(differing) - len(moved)
        result["cause"] = "not the batch composition"
        result["explanation"] = (
            f"{same} differing sample(s) were evaluated in the same batch in both runs: the batch composition does not"
            " explain them; compare the evaluated weights (fingerprint/final) and the data"
        )
    return result


def _describe(batch: dict[str, Any], key: str) -> str:
    index = int(key.split("/")[1])
    return (
        f"batch of {len(batch['indices'])} on rank {batch['rank']} (position {batch['indices'].index(index)},"
        f" batch {batch['batch']})"
    )


def format_samples(result: dict[str, Any], stage: str) -> list[str]:
    """The text lines of a :func:`compare_samples` result."""
    lines = [f"per-sample record ({stage}): {result['compared']} samples in both"]
    for side in ("a", "b"):
        missing = result[f"only_in_{side}"]
        if missing:
            lines.append(f"  {len(missing)} only in run {side.upper()} (e.g. {', '.join(missing[:_SHOWN])})")
    if not result["differing"]:
        lines.append("  every sample's result is the same bits")
        return lines
    lines.append(f"  {len(result['differing'])} of {result['compared']} samples differ (dataloader/index):")
    for example in result["examples"]:
        key = example["sample"]
        lines.append(f"    {key}: {example['a']} vs {example['b']}")
        lines.append(f"      A: {_describe(example['batch_a'], key)}; B: {_describe(example['batch_b'], key)}")
    if len(result["differing"]) > len(result["examples"]):
        lines.append(f"    ... and {len(result['differing']) - len(result['examples'])} more")
    lines.append(f"  cause: {result['cause']}: {result['explanation']}")
    return lines
