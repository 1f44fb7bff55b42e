"""Reading the determinism record back from loggers' files: the event-file reader against tensorboardX's own writer,
hparams.yaml with a user's python-tagged value, and the one-line refusals (exit status 2)."""

import pytest
from lightning.pytorch.loggers import TensorBoardLogger

import _lightning_determinism_cli as entry
from lightning_determinism.divergence._event_file import read_event_file, session_hparams
from lightning_determinism.divergence.logger_record import RecordError, read_record


def tensorboard_run(root, version=0, seed=5):
    logger = TensorBoardLogger(root, name="tb", version=version)
    logger.log_hyperparams({"determinism/seed": seed, "determinism/flag": True, "determinism/none": None, "x": 0.25})
    logger.experiment.add_text("determinism/fingerprint", "f" * 64, 3)
    logger.experiment.add_text("determinism/fingerprint/final", "e" * 64, 4)
    logger.log_hyperparams({"determinism/late": "v"})
    logger.finalize("success")
    (path,) = (root / "tb" / f"version_{version}").glob("events.out.tfevents.*")
    return path


def test_the_event_file_reader_reads_what_tensorboardx_wrote(tmp_path):
    path = tensorboard_run(tmp_path)
    hparams, texts = read_event_file(path)
    assert hparams == {"determinism/seed": 5.0, "determinism/flag": True, "determinism/none": "None", "x": 0.25,
                       "determinism/late": "v"}  # fmt: skip
    assert texts == [(3, "determinism/fingerprint", "f" * 64), (4, "determinism/fingerprint/final", "e" * 64)]
    assert [sorted(h) for h in session_hparams(path)][1] == ["determinism/late"]
    record, where = read_record(tmp_path / "tb")
    assert where == tmp_path / "tb" / "version_0"
    assert record == {"determinism/seed": 5, "determinism/flag": True, "determinism/none": None,
                      "determinism/late": "v", "determinism/fingerprint/step_3": "f" * 64,
                      "determinism/fingerprint/final": "e" * 64}  # fmt: skip
    # A run still writing (or killed) ends in a record cut short: what came before it is read.
    data = path.read_bytes()
    cut_texts = []
    for end in (len(data) // 2, len(data) - 7):
        path.write_bytes(data[:end])
        cut_texts.append(read_event_file(path)[1])
    assert cut_texts[0] == texts[: len(cut_texts[0])] and cut_texts[1] == texts


def test_hparams_yaml_with_a_users_python_object_reads(tmp_path):
    import yaml

    # What Lightning's CSVLogger writes for a tuple without omegaconf installed (with it: a plain list)
    path = tmp_path / "csv" / "version_0" / "hparams.yaml"
    path.parent.mkdir(parents=True)
    path.write_text(yaml.dump({"determinism/seed": 9, "shape": (2, 3)}))
    assert "!!python/tuple" in path.read_text()
    assert read_record(path)[0] == {"determinism/seed": 9}


def test_unusable_logger_directories_are_refused_in_one_line(tmp_path, capsys):
    tensorboard_run(tmp_path / "two", 0)
    tensorboard_run(tmp_path / "two", 1, seed=6)
    plain = tmp_path / "plain" / "csv" / "version_0"
    plain.mkdir(parents=True)
    (plain / "hparams.yaml").write_text("lr: 0.1\n")
    garbage = tmp_path / "garbage" / "events.out.tfevents.1.host"
    garbage.parent.mkdir()
    garbage.write_bytes(b"\x05" + b"\x00" * 11 + b"\xff\xff\xff\xff\xff" + b"\x00" * 4)
    with pytest.raises(RecordError, match="holds the logs of 2 runs whose records differ"):
        read_record(tmp_path / "two")
    tensorboard_run(tmp_path / "same", 0)  # one run's logs twice (a CSV and a TensorBoard logger): read as one
    tensorboard_run(tmp_path / "same", 1)
    assert read_record(tmp_path / "same") == read_record(tmp_path / "same" / "tb" / "version_0")[:1] + (
        tmp_path / "same",
    )
    for path, message in (
        (plain, f"{plain}: no determinism record in the logger's files"),
        (garbage.parent, f"{garbage}: not a readable TensorBoard event file"),
        (tmp_path / "two", f"{tmp_path / 'two'}: holds the logs of 2 runs"),
    ):
        assert entry.main(["compare", str(path), str(path)]) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith(f"lightning-determinism: error: {message}"), line
    baseline = tmp_path / "a.json"
    baseline.write_text("{}")
    assert entry.main(["compare", str(baseline), str(tmp_path / "two" / "tb" / "version_0")]) == 2
    assert "either baseline files or loggers' directories" in capsys.readouterr().err
