"""Reading the determinism record back from a logger's output directory: CSV's and TensorBoard's (and trackers').

A ``CSVLogger`` keeps its hyperparameters in ``<save_dir>/<name>/version_<n>/hparams.yaml``; a ``TensorBoardLogger``
in the event file (``events.out.tfevents.*``) beside its own ``hparams.yaml`` (written once, at the start of fit), and
the fingerprints as texts of the event file. :func:`read_record` takes such a version directory, a directory above
them (one run's: a CSV and a TensorBoard logger side by side, whose records agree), or one of the files, and returns
the record's flat ``determinism/...`` entries (:mod:`~lightning_determinism.divergence.run_record`). The event file is
read by :mod:`~lightning_determinism.divergence._event_file` (no TensorBoard needed); YAML by PyYAML, which Lightning
requires. MLflow's runs (``runs:/<run_id>``, a file store's run directory) and W&B's offline run directories are read
by :mod:`~lightning_determinism.divergence.tracker_record`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_determinism.divergence._event_file import EventFileError, read_event_file
from lightning_determinism.divergence.run_record import FINGERPRINT_PREFIX, PREFIX, differences, record_of
from lightning_determinism.divergence.tracker_record import (
    MLFLOW_RUN_URI,
    WANDB_SUFFIX,
    TrackerError,
    is_mlflow_run_directory,
    mlflow_directory_params,
    mlflow_uri_params,
    wandb_file_config,
    wandb_run_files,
)

HPARAMS_FILE = "hparams.yaml"
EVENTS_GLOB = "events.out.tfevents.*"
_MAX_DEPTH = 3  # save_dir / name / version_n: a directory a user may point at holds the logs that deep


class RecordError(ValueError):
    """A path that holds no readable determinism record (said in one line, exit status 2)."""


def _holds_logs(directory: Path) -> bool:
    return (
        (directory / HPARAMS_FILE).is_file()
        or any(directory.glob(EVENTS_GLOB))
        or is_mlflow_run_directory(directory)
        or bool(wandb_run_files(directory))
    )


def log_directories(path: Path) -> list[Path]:
    """The directories at or below ``path`` (three levels at most) that hold a logger's files, sorted."""
    found: list[Path] = []
    level = [path]
    for _ in range(_MAX_DEPTH + 1):
        found.extend(d for d in level if _holds_logs(d))
        level = sorted(child for d in level if not _holds_logs(d) for child in d.iterdir() if child.is_dir())
    return sorted(found)


def _yaml_hparams(path: Path) -> dict[str, Any]:
    import yaml

    class _Loader(yaml.SafeLoader):
        """Safe, and a user's python-tagged hyperparameter (a Namespace, a class) reads as its tag, not an error."""

    _Loader.add_multi_constructor("", lambda loader, suffix, node: f"<{suffix}>")
    try:
        loaded = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)  # noqa: S506  (a safe loader)
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise RecordError(f"{path}: not a readable hparams.yaml ({str(err).splitlines()[0]})") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise RecordError(f"{path}: hparams.yaml holds a {type(loaded).__name__}, not a mapping")
    return loaded


def _event_hparams(path: Path) -> dict[str, Any]:
    try:
        hparams, texts = read_event_file(path)
    except (EventFileError, OSError) as err:
        raise RecordError(f"{path}: not a readable TensorBoard event file ({err})") from None
    for step, tag, text in texts:
        if tag.startswith(FINGERPRINT_PREFIX):  # "determinism/fingerprint/final"
            hparams[tag] = text
        elif tag == FINGERPRINT_PREFIX.rstrip("/"):  # at a checkpoint: the step is the text's
            hparams[f"{FINGERPRINT_PREFIX}step_{step}"] = text
    return hparams


def _read_files(files: list[Path]) -> dict[str, Any]:
    hparams: dict[str, Any] = {}
    try:
        for file in files:
            if file.is_dir():  # an MLflow file store run's params/
                hparams.update(mlflow_directory_params(file))
            elif file.suffix == WANDB_SUFFIX:
                hparams.update(wandb_file_config(file))
            else:
                hparams.update(_yaml_hparams(file) if file.suffix in (".yaml", ".yml") else _event_hparams(file))
    except TrackerError as err:
        raise RecordError(str(err)) from None
    return hparams


def _files_of(directory: Path) -> list[Path]:
    if is_mlflow_run_directory(directory):
        return [directory / "params"]
    if wandb_run_files(directory):
        return wandb_run_files(directory)
    yaml_file = directory / HPARAMS_FILE
    return ([yaml_file] if yaml_file.is_file() else []) + sorted(directory.glob(EVENTS_GLOB))


def _one_run(path: Path, runs: list[Path]) -> tuple[dict[str, Any], Path]:
    """The record of a directory above several loggers' directories: one run's, or a refusal naming them.

    The logs of one run (a CSV and a TensorBoard logger side by side) hold equal records: they are read as one.
    """
    records = {run: record_of(_read_files(_files_of(run))) for run in runs}
    found = {run: record for run, record in records.items() if record}
    merged: dict[str, Any] = {}
    for record in found.values():
        merged.update(record)
    if found and all(not differences(record, merged) for record in found.values()):
        return merged, path
    shown = ", ".join(str(run) for run in runs[:4]) + (", ..." if len(runs) > 4 else "")
    why = "whose records differ" if found else "none with a determinism record"
    raise RecordError(f"{path}: holds the logs of {len(runs)} runs {why} ({shown}); give one of them")


def read_record(path: Path | str) -> tuple[dict[str, Any], Path]:
    """The record a logger wrote at ``path``, and the directory (or file) it was read from.

    An event file's entries are read over ``hparams.yaml``'s (TensorBoard writes that file once, before the
    fingerprints); several event files of one directory in the order of their names (of their times). ``runs:/<id>``
    names an MLflow run (read with MLflow's client); an MLflow file store's run directory and a W&B offline run
    directory (or its ``.wandb`` file) are read as a logger's directory is.

    Raises:
        RecordError: if ``path`` holds no logger's files, the logs of several runs whose records differ, or no record.
    """
    if str(path).startswith(MLFLOW_RUN_URI):
        try:
            hparams = mlflow_uri_params(str(path))
        except TrackerError as err:
            raise RecordError(str(err)) from None
        record = record_of(hparams)
        if not record:
            raise RecordError(f"{path}: no determinism record among the run's parameters (no {PREFIX}... entry)")
        return record, Path(str(path))
    path = Path(path)
    if path.is_file():
        where, files = path, [path]
    elif path.is_dir():
        runs = log_directories(path)
        if not runs:
            raise RecordError(
                f"{path}: no {HPARAMS_FILE} or TensorBoard event file in it or below (expected a logger's output"
                " directory, such as lightning_logs/version_0)"
            )
        if len(runs) > 1:
            return _one_run(path, runs)
        where = runs[0]
        files = _files_of(where)
    else:
        raise RecordError(f"{path}: no such file or directory")
    if path.is_file() and path.suffix == ".db":
        raise RecordError(
            f"{path}: an MLflow database, not a logger's file: name the run as runs:/<run_id>, with"
            f" MLFLOW_TRACKING_URI=sqlite:///{path.resolve()}"
        )
    record = record_of(_read_files(files))
    if not record:
        raise RecordError(
            f"{where}: no determinism record in the logger's files (no {PREFIX}... entry: the run was not under a"
            " deterministic strategy, or ran with log_record=False and no DeterminismRecord callback)"
        )
    return record, where


__all__ = ["EVENTS_GLOB", "HPARAMS_FILE", "RecordError", "log_directories", "read_record"]
