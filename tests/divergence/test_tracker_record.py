"""`compare` and `report` on experiment trackers' runs: MLflow (a file store's run directory, `runs:/<id>`) and W&B
offline runs; one line naming what to install where a reader's package is missing.

The MLflow run directory is laid out here as MLflow's file store writes it (one file per parameter, the key its path,
the value its text; checked against MLflow itself in the test that needs it). W&B's run file framing is built here
from its definition (LevelDB's log format behind a `:W&B` header); decoding its records needs wandb.
"""

import struct
import sys

import pytest
import yaml

import _lightning_determinism_cli as entry
from lightning_determinism.divergence.logger_record import RecordError, read_record
from lightning_determinism.divergence.tracker_record import _fragments

RECORD = {"determinism/seed": 5, "determinism/debug_mode": "error", "determinism/flag": True,
          "determinism/fingerprint/final": "ab" * 32}  # fmt: skip


def _csv_run(directory, record):
    directory.mkdir(parents=True)
    (directory / "hparams.yaml").write_text(yaml.safe_dump({"lr": 0.1, **record}))
    return directory


def _mlflow_file_store_run(root, record, run_id="0123abcd"):
    run = root / "mlruns" / "1" / run_id
    (run / "params").mkdir(parents=True)
    (run / "meta.yaml").write_text(f"run_id: {run_id}\n")
    for key, value in {"lr": 0.1, **record}.items():
        path = run / "params" / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(str(value))  # MLflow keeps every parameter as text
    return run


def test_an_mlflow_file_store_run_compares_with_a_csv_run_value_for_value(tmp_path, capsys):
    csv = _csv_run(tmp_path / "csv", RECORD)
    run = _mlflow_file_store_run(tmp_path, RECORD)
    record, where = read_record(run)
    assert where == run and record["determinism/seed"] == "5"  # text, as MLflow keeps it
    assert entry.main(["compare", str(csv), str(run)]) == 0
    other = _mlflow_file_store_run(tmp_path / "other", {**RECORD, "determinism/seed": 6})
    capsys.readouterr()
    assert entry.main(["compare", str(csv), str(other)]) == 1
    assert "these two runs differ in: seed" in capsys.readouterr().out
    # the store's root holds two runs whose records differ: one of them must be named
    _mlflow_file_store_run(tmp_path / "other", RECORD, run_id="4567")
    with pytest.raises(RecordError, match=r"holds the logs of 2 runs whose records differ"):
        read_record(tmp_path / "other" / "mlruns")


def test_without_mlflow_a_run_uri_is_refused_in_one_line_naming_what_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    csv = _csv_run(tmp_path / "csv", RECORD)
    assert entry.main(["compare", str(csv), "runs:/0123abcd"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "lightning-determinism: error: runs:/0123abcd: reading an MLflow run needs MLflow: pip install mlflow-skinny"
        " (or name the run's directory in a file store, mlruns/<experiment>/<run_id>, which needs nothing)"
    ]


def test_an_mlflow_database_points_to_runs_uris(tmp_path, capsys):
    db = tmp_path / "mlflow.db"
    db.write_bytes(b"SQLite format 3\x00")
    assert entry.main(["compare", str(_csv_run(tmp_path / "csv", RECORD)), str(db)]) == 2
    assert "an MLflow database, not a logger's file: name the run as runs:/<run_id>" in capsys.readouterr().err


def _frame(records: list[bytes], block: int = 32768) -> bytes:
    """A W&B run file: the `:W&B` header, then each record in fragments that never cross a 32 KiB block."""
    out = bytearray(struct.pack("<4sHB", b":W&B", 0xBEE1, 0))
    for record in records:
        rest, first = record, True
        while True:
            left = block - len(out) % block
            if left < 7:
                out += b"\x00" * left
                continue
            piece, rest = rest[: left - 7], rest[left - 7 :]
            kind = (1 if not rest else 2) if first else (4 if not rest else 3)
            out += struct.pack("<IHB", 0, len(piece), kind) + piece
            first = False
            if not rest:
                break
    return bytes(out)


def test_the_wandb_run_file_framing_joins_fragments_across_blocks(tmp_path):
    records = [b"a" * 10, b"b" * 70000, b"c" * 32755, b"d"]  # one spans three blocks; one ends a block exactly
    path = tmp_path / "run-x.wandb"
    data = _frame(records)
    assert _fragments(data, path) == records
    assert _fragments(data[:-1], path) == records[:-1]  # a run still writing: what came before is read
    with pytest.raises(ValueError, match="not a W&B run file"):
        _fragments(b"SQLite format 3", path)


def test_without_wandb_a_wandb_run_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb.proto", None)
    run = tmp_path / "wandb" / "offline-run-20261206_000000-abc"
    run.mkdir(parents=True)
    (run / "run-abc.wandb").write_bytes(_frame([b"x"]))
    assert entry.main(["compare", str(_csv_run(tmp_path / "csv", RECORD)), str(run)]) == 2
    assert "reading a W&B run needs wandb's record format: pip install wandb" in capsys.readouterr().err


def _fit(tmp_path, logger):
    from lightning.pytorch.loggers import CSVLogger

    from lightning_determinism import DeterministicSingleDeviceStrategy
    from tests.helpers.lightning_models import RecordingModule, quiet_trainer

    loggers = [logger, CSVLogger(tmp_path, name="csv", version=0)]
    quiet_trainer(DeterministicSingleDeviceStrategy(device="cpu", seed=5), devices=1, max_epochs=1,
                  logger=loggers).fit(RecordingModule(str(tmp_path), n=8))  # fmt: skip
    return tmp_path / "csv" / "version_0"


def test_a_real_mlflow_run_reads_as_runs_uri_and_as_its_directory(tmp_path, monkeypatch, capsys):
    pytest.importorskip("mlflow")  # not among the test extras: run where MLflow is installed
    from lightning.pytorch.loggers import MLFlowLogger

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    logger = MLFlowLogger(tracking_uri=f"file:{tmp_path / 'mlruns'}")
    csv = _fit(tmp_path, logger)
    run_dir = tmp_path / "mlruns" / logger.experiment_id / logger.run_id
    assert entry.main(["compare", str(csv), f"runs:/{logger.run_id}", str(run_dir)]) == 0
    assert read_record(f"runs:/{logger.run_id}")[0] == read_record(run_dir)[0]


def test_a_real_wandb_offline_run_reads_as_its_directory(tmp_path, monkeypatch):
    pytest.importorskip("wandb")  # not among the test extras: run where wandb is installed
    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    csv = _fit(tmp_path, WandbLogger(offline=True, save_dir=str(tmp_path), project="p"))
    import wandb

    wandb.finish()
    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    assert read_record(run)[0] == read_record(csv)[0]
    assert entry.main(["compare", str(csv), str(run)]) == 0
