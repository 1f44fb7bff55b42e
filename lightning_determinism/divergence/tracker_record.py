"""Reading the determinism record from experiment trackers' runs: MLflow's and Weights & Biases' offline runs.

- MLflow: ``runs:/<run_id>`` is read with MLflow's own client (``MlflowClient().get_run``), from the tracking URI MLflow
  itself would use (``MLFLOW_TRACKING_URI``: a server, ``sqlite:///mlflow.db``, a directory). A run directory of a
  file store (``mlruns/<experiment>/<run_id>``, with its ``meta.yaml`` and ``params/``) is read from its files: one
  file per parameter, the key its path, no MLflow needed. MLflow keeps parameters as strings: ``compare`` matches
  ``"5"`` with a CSV record's ``5`` (:func:`~lightning_determinism.divergence.run_record.differences`).
- W&B: an offline run directory (``wandb/offline-run-<time>-<id>``, as ``WandbLogger(offline=True)`` leaves it) keeps
  its config in ``run-<id>.wandb``, a log of W&B's protobuf records in LevelDB's log framing (32 KiB blocks of
  7-byte-headed fragments after a 7-byte ``:W&B`` file header). The framing is read here; each record is decoded by
  wandb's own ``wandb_internal_pb2.Record``, so wandb must be installed (one line says so where it is not).

Without the package a reader needs, :class:`~lightning_determinism.divergence.logger_record.RecordError` names what
to install.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

MLFLOW_RUN_URI = "runs:/"
WANDB_SUFFIX = ".wandb"
_BLOCK = 32768
_HEADER = struct.Struct("<IHB")  # checksum, length, fragment type
_FILE_HEADER = struct.Struct("<4sHB")  # ":W&B", magic, version
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


class TrackerError(ValueError):
    """A tracker's run that cannot be read (said in one line, exit status 2)."""


def is_mlflow_run_directory(directory: Path) -> bool:
    """A file store's run directory: ``meta.yaml`` beside ``params/``."""
    return (directory / "meta.yaml").is_file() and (directory / "params").is_dir()


def wandb_run_files(directory: Path) -> list[Path]:
    """The ``run-*.wandb`` files of a W&B run directory (none elsewhere)."""
    return sorted(directory.glob(f"run-*{WANDB_SUFFIX}"))


def mlflow_directory_params(params: Path) -> dict[str, Any]:
    """A file store run's parameters: every file below ``params/``, its relative path the key, its text the value."""
    out: dict[str, Any] = {}
    for file in sorted(p for p in params.rglob("*") if p.is_file()):
        out[file.relative_to(params).as_posix()] = file.read_text(encoding="utf-8")
    return out


def mlflow_uri_params(uri: str) -> dict[str, Any]:
    """The parameters of ``runs:/<run_id>`` (``/<path>`` after the id ignored), read with MLflow's client.

    Raises:
        TrackerError: without MLflow, or for a run the tracking server does not know, in one line.
    """
    run_id = uri[len(MLFLOW_RUN_URI) :].strip("/").split("/")[0]
    if not run_id:
        raise TrackerError(f"{uri}: no run id (expected runs:/<run_id>)")
    try:
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise TrackerError(
            f"{uri}: reading an MLflow run needs MLflow: pip install mlflow-skinny (or name the run's directory in a"
            " file store, mlruns/<experiment>/<run_id>, which needs nothing)"
        ) from None
    tracking = os.environ.get("MLFLOW_TRACKING_URI", "(MLflow's default)")
    try:
        return dict(MlflowClient().get_run(run_id).data.params)
    except Exception as err:  # MlflowException and the store's own errors
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise TrackerError(f"{uri}: not readable from the tracking URI {tracking} ({first})") from None


def _fragments(data: bytes, path: Path) -> list[bytes]:
    """The records of a LevelDB-framed log (W&B's ``.wandb``), its fragments joined."""
    if len(data) < _FILE_HEADER.size or _FILE_HEADER.unpack_from(data)[0] != b":W&B":
        raise TrackerError(f"{path}: not a W&B run file (no :W&B header)")
    records: list[bytes] = []
    pending: list[bytes] = []
    pos = _FILE_HEADER.size
    while pos + _HEADER.size <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER.size:  # a block's tail too short for a header: padding
            pos += left
            continue
        _, length, kind = _HEADER.unpack_from(data, pos)
        if kind == 0 and length == 0:  # zeros to the block's end
            pos += left
            continue
        payload = data[pos + _HEADER.size : pos + _HEADER.size + length]
        if len(payload) < length:  # a run still writing (or killed): what came before is read
            break
        pos += _HEADER.size + length
        if kind == _FULL:
            records.append(payload)
        elif kind == _FIRST:
            pending = [payload]
        elif kind == _MIDDLE:
            pending.append(payload)
        elif kind == _LAST:
            records.append(b"".join([*pending, payload]))
            pending = []
    return records


def wandb_file_config(path: Path) -> dict[str, Any]:
    """The config a W&B run file holds, every update applied in order (the record is logged as config).

    Raises:
        TrackerError: without wandb, or for a file that is not a W&B run file.
    """
    try:
        from wandb.proto import wandb_internal_pb2
    except ImportError:
        raise TrackerError(f"{path}: reading a W&B run needs wandb's record format: pip install wandb") from None
    config: dict[str, Any] = {}
    for payload in _fragments(path.read_bytes(), path):
        record = wandb_internal_pb2.Record()  # type: ignore[attr-defined,unused-ignore]
        try:
            record.ParseFromString(payload)
        except Exception:  # a cut record at the end of a run that was killed
            continue
        kind = record.WhichOneof("record_type")
        updates = record.config.update if kind == "config" else record.run.config.update if kind == "run" else ()
        for item in updates:
            key = item.key or "/".join(item.nested_key)
            config[key] = json.loads(item.value_json)
    return config


__all__ = [
    "MLFLOW_RUN_URI",
    "WANDB_SUFFIX",
    "TrackerError",
    "is_mlflow_run_directory",
    "mlflow_directory_params",
    "mlflow_uri_params",
    "wandb_file_config",
    "wandb_run_files",
]
