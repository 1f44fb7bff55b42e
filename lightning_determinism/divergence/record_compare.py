"""``compare`` and ``report`` on loggers' directories: what two runs' determinism records say, and where they differ.

    lightning-determinism compare logs/a/version_0 logs/b/version_0      # CSV or TensorBoard directories
    lightning-determinism report logs/a/version_0

Each record is read by :func:`~lightning_determinism.divergence.logger_record.read_record`; every run is compared with
the first, entry by entry, and the differences are named in one line ("differ in: seed, torch version"). Exit status
as for baseline files: 0 when the records agree, 1 when any differs; bad input is raised as
:class:`~lightning_determinism.divergence.logger_record.RecordError` (one line, status 2).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lightning_determinism.divergence.logger_record import read_record
from lightning_determinism.divergence.run_record import PREFIX, differ_in, differences, fingerprints
from lightning_determinism.divergence.sample_record import compare_samples, format_samples, load_samples, records_in

_RECORD_SUFFIXES = (".yaml", ".yml")


def is_record_path(path: str) -> bool:
    """Whether a command-line input names a logger's output: a directory, a file of one, an MLflow run or database.

    Files: ``hparams.yaml``, an event file, a W&B ``.wandb`` run file; ``runs:/<id>`` names an MLflow run.

    A distributed checkpoint directory (one with ``meta.pt``) is a checkpoint, not a logger's directory.

    Examples:
        >>> is_record_path("run.json"), is_record_path("hparams.yaml"), is_record_path("events.out.tfevents.1.host")
        (False, True, True)
    """
    if path.startswith("runs:/"):  # an MLflow run
        return True
    p = Path(path)
    if p.is_dir():
        return not (p / "meta.pt").is_file()
    return p.suffix in (*_RECORD_SUFFIXES, ".wandb", ".db") or p.name.startswith("events.out.tfevents.")


def _short(value: Any, width: int = 24) -> str:
    text = "-" if value is None else str(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def compare_records(paths: list[str], as_json: bool = False) -> int:
    """Compare the records of ``paths[1:]`` with ``paths[0]``'s; print the differences; 0 if all agree, else 1.

    Raises:
        RecordError: for a path that holds no record (or the logs of several runs).
    """
    read = [read_record(path) for path in paths]
    (reference, ref_where), others = read[0], read[1:]
    runs: list[dict[str, Any]] = []
    ref_samples = records_in(ref_where)
    ref_loaded: dict[str, dict[str, Any]] = {}  # the reference's records, read once for every run compared with them
    for path, (record, where) in zip(paths[1:], others, strict=True):
        diff = differences(reference, record)
        samples = records_in(where)
        runs.append({"path": path, "read_from": str(where), "differ_in": differ_in(list(diff)),
                     "differences": {key: list(pair) for key, pair in diff.items()},
                     "samples": _sample_comparisons(ref_samples, samples, ref_loaded),
                     "samples_in_one": _one_sided(ref_samples, samples)})  # fmt: skip
    if as_json:
        print(json.dumps({"reference": paths[0], "read_from": str(ref_where), "runs": runs}, indent=2))
        return 1 if any(_differs(run) for run in runs) else 0
    print(f"reference: {paths[0]} ({len(reference)} entries, read from {ref_where})")
    for run in runs:
        entries: dict[str, list[Any]] = run["differences"]
        print(f"\n{run['path']} ({run['read_from']}):")
        for stage, result in run["samples"].items():
            print("\n".join(format_samples(result, stage)))
        for stage, holder in run["samples_in_one"].items():
            print(f"per-sample record ({stage}): only in {holder}; nothing to compare sample by sample")
        if not entries:
            taken = ", ".join(fingerprints(reference)) or "none recorded"
            print(f"  the records agree: {len(reference)} entries (fingerprints at: {taken})")
            continue
        width = max(len(key) - len(PREFIX) for key in entries)
        print(f"  {'entry':<{width}}  {'reference':<24}  this run")
        for key, (a, b) in entries.items():
            print(f"  {key[len(PREFIX) :]:<{width}}  {_short(a):<24}  {_short(b)}")
        names = ", ".join(run["differ_in"])
        print(f"these two runs differ in: {names}" if len(paths) == 2 else f"  differs from the reference in: {names}")
    if len(paths) > 2:
        differing = sum(1 for run in runs if _differs(run))
        print(f"\n{differing} of {len(runs)} runs differ from {paths[0]}" if differing else
              f"\nall {len(runs)} runs agree with {paths[0]}")  # fmt: skip
    return 1 if any(_differs(run) for run in runs) else 0


def _sample_comparisons(
    reference: dict[str, Path], other: dict[str, Path], loaded: dict[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """The per-sample records (SampleRecord) both runs hold, compared stage by stage (``loaded``: the reference's)."""
    compared = {}
    for stage in sorted(set(reference) & set(other)):
        if stage not in loaded:
            loaded[stage] = load_samples(reference[stage])
        compared[stage] = compare_samples(loaded[stage], load_samples(other[stage]))
    return compared


def _one_sided(reference: dict[str, Path], other: dict[str, Path]) -> dict[str, str]:
    """The stages whose per-sample record only one of the two runs holds, and which one."""
    return {
        stage: "the reference" if stage in reference else "this run" for stage in sorted(set(reference) ^ set(other))
    }


def _differs(run: dict[str, Any]) -> bool:
    return bool(run["differences"]) or any(result["differing"] for result in run["samples"].values())


def report_record(path: str, as_json: bool = False) -> int:
    """Print the record a logger's directory holds; returns 0.

    Raises:
        RecordError: for a path that holds no record (or the logs of several runs).
    """
    record, where = read_record(path)
    if as_json:
        print(json.dumps(record, indent=2))
        return 0
    print(f"{path}: determinism record ({len(record)} entries, read from {where})")
    width = max(len(key) - len(PREFIX) for key in record)
    for key, value in sorted(record.items()):
        print(f"  {key[len(PREFIX) :]:<{width}}  {value}")
    return 0


__all__ = ["compare_records", "is_record_path", "report_record"]
