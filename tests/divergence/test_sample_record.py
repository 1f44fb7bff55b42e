"""The per-sample record: what compare_samples concludes from two, the file checks, SampleRecord's own checks."""

import json

import lightning as L
import pytest
import torch

import _lightning_determinism_cli as entry
from lightning_determinism import SampleRecord
from lightning_determinism.callbacks.sample_record import encode_result
from lightning_determinism.divergence.sample_record import (
    FORMAT,
    KIND,
    SampleRecordError,
    compare_samples,
    load_samples,
)


def _record(batches, results, invariant=False, world_size=1):
    """A record of samples 0..n-1 of loader 0: ``batches`` as (rank, [indices]), ``results`` by index."""
    number = {i: k for k, (_, indices) in enumerate(batches) for i in indices}
    return {
        "kind": KIND, "format": FORMAT, "stage": "validate", "epoch": 0, "step": 0, "world_size": world_size,
        "batch_invariant": invariant,
        "batches": [[rank, 0, k, indices] for k, (rank, indices) in enumerate(batches)],
        "samples": {f"0/{i}": [results[i], number[i]] for i in sorted(number)},
    }  # fmt: skip


ONE_BATCH = [(0, [0, 1, 2, 3])]
TWO_RANKS = [(0, [0, 1]), (1, [2, 3])]


def test_samples_that_moved_to_other_batches_with_the_mode_off_name_the_batch_composition():
    a = _record(ONE_BATCH, ["x0", "x1", "x2", "x3"])
    b = _record(TWO_RANKS, ["x0", "y1", "x2", "y3"], world_size=2)
    result = compare_samples(a, b)
    assert result["differing"] == ["0/1", "0/3"]
    assert result["cause"] == "batch composition"
    assert result["examples"][1]["batch_b"] == {"rank": 1, "dataloader": 0, "batch": 1, "indices": [2, 3]}


def test_a_sample_that_differs_in_the_same_batch_is_not_the_batch_composition():
    same = [(0, [0, 1]), (0, [2, 3])]
    result = compare_samples(_record(same, ["x0", "x1", "x2", "x3"]), _record(same, ["x0", "x1", "x2", "y3"]))
    assert result["differing"] == ["0/3"]
    assert result["cause"] == "not the batch composition"
    assert "1 differing sample(s) were evaluated in the same batch" in result["explanation"]


def test_with_the_mode_on_in_both_runs_the_batch_composition_is_ruled_out():
    a = _record(ONE_BATCH, ["x0", "x1", "x2", "x3"], invariant=True)
    b = _record(TWO_RANKS, ["x0", "x1", "x2", "y3"], invariant=True, world_size=2)
    result = compare_samples(a, b)
    assert result["cause"] == "not the batch composition"
    assert "on in both runs" in result["explanation"]
    c = _record(TWO_RANKS, ["y0", "y1", "y2", "y3"], invariant=False, world_size=2)
    assert compare_samples(a, c)["cause"] == "batch-invariant evaluation in one run only"


def test_equal_records_and_missing_samples():
    a = _record(ONE_BATCH, ["x0", "x1", "x2", "x3"])
    b = _record([(0, [0, 1, 2])], ["x0", "x1", "x2"])
    result = compare_samples(a, b)
    assert (result["differing"], result["cause"], result["only_in_a"]) == ([], None, ["0/3"])


def test_the_command_line_diagnoses_two_files(tmp_path, capsys):
    a, b = tmp_path / "determinism_samples_validate.json", tmp_path / "b" / "determinism_samples_validate.json"
    b.parent.mkdir()
    a.write_text(json.dumps(_record(ONE_BATCH, ["x0", "x1", "x2", "x3"])))
    b.write_text(json.dumps(_record(TWO_RANKS, ["x0", "y1", "x2", "x3"], world_size=2)))
    assert entry.main(["diagnose", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "1 of 4 samples differ" in out
    assert "0/1: x1 vs y1" in out
    assert "A: batch of 4 on rank 0 (position 1, batch 0); B: batch of 2 on rank 0 (position 1, batch 0)" in out
    assert "cause: batch composition" in out
    assert entry.main(["compare", str(a), str(b), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["runs"][str(b)]["differing"] == ["0/1"]
    b.write_text(json.dumps({**json.loads(b.read_text()), "format": 99}))
    assert entry.main(["diagnose", str(a), str(b)]) == 2
    assert "a per-sample record of format 99, this version reads 1" in capsys.readouterr().err


def test_a_file_that_is_not_a_record_is_refused(tmp_path):
    path = tmp_path / "determinism_samples_test.json"
    path.write_text("[1, 2]")
    with pytest.raises(SampleRecordError, match="not a per-sample record"):
        load_samples(path)
    path.write_text("{")
    with pytest.raises(SampleRecordError, match="not JSON"):
        load_samples(path)


def test_results_keep_every_bit():
    value = torch.tensor(1.0, dtype=torch.bfloat16) + torch.tensor(2**-7, dtype=torch.bfloat16)
    assert float.fromhex(encode_result(value)) == value.item()
    assert encode_result(torch.tensor([1.0, 2.0])) != encode_result(torch.tensor([1.0, 2.0000002]))
    assert encode_result(torch.zeros(0)).startswith("torch.float32 (0,)")


def test_sample_record_refuses_bad_keys_and_survives_pickling():
    with pytest.raises(TypeError, match=r"`value_key` must be a str, got int 3"):
        SampleRecord(value_key=3)
    import pickle

    record = pickle.loads(pickle.dumps(SampleRecord(value_key="loss", index_key="id", dirpath="out")))  # spawn
    assert (record.value_key, record.index_key, record.dirpath) == ("loss", "id", "out")


class _Scorer(L.LightningModule):
    """Scores samples 0..9 (the dataset yields its index): one number each, in test and predict steps."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def _scores(self, batch):
        return {"sample_value": self.layer(batch["x"])[:, 0], "index": batch["index"]}

    def test_step(self, batch, batch_idx):
        return self._scores(batch)

    def predict_step(self, batch, batch_idx):
        return self._scores(batch)


def _items():
    gen = torch.Generator().manual_seed(3)
    return [{"index": i, "x": torch.randn(4, generator=gen)} for i in range(10)]


@pytest.mark.parametrize("stage", ["test", "predict"])
def test_sample_record_writes_test_and_predict_passes(tmp_path, stage):
    from torch.utils.data import DataLoader

    from lightning_determinism import DeterministicSingleDeviceStrategy
    from tests.helpers.lightning_models import quiet_trainer

    records = {}
    for size in (1, 4):
        torch.manual_seed(0)
        model = _Scorer()
        trainer = quiet_trainer(
            DeterministicSingleDeviceStrategy(device="cpu", seed=1, batch_invariant=True), devices=1,
            callbacks=[SampleRecord(dirpath=str(tmp_path / str(size)))],
        )  # fmt: skip
        getattr(trainer, stage)(model, DataLoader(_items(), batch_size=size))
        records[size] = load_samples(tmp_path / str(size) / f"determinism_samples_{stage}.json")
    one, four = records[1], records[4]
    assert (one["stage"], one["batch_invariant"], len(one["samples"])) == (stage, True, 10)
    assert four["batches"][2] == [0, 0, 2, [8, 9]]
    result = compare_samples(one, four)
    assert result["compared"] == 10 and result["differing"] == []  # the mode: a sample's score whatever its batch


def test_compare_of_two_loggers_directories_reads_their_per_sample_records(tmp_path, capsys):
    import yaml

    record = {"determinism/seed": 5, "determinism/world_size": 1}
    runs = {}
    for name, results in (
        ("a", ["x0", "x1", "x2", "x3"]),
        ("b", ["x0", "x1", "x2", "x3"]),
        ("c", ["x0", "y1", "x2", "x3"]),
    ):
        run = tmp_path / name
        run.mkdir()
        (run / "hparams.yaml").write_text(yaml.safe_dump(record))
        (run / "determinism_samples_validate.json").write_text(json.dumps(_record(ONE_BATCH, results)))
        runs[name] = str(run)
    assert entry.main(["compare", runs["a"], runs["b"]]) == 0
    assert "every sample's result is the same bits" in capsys.readouterr().out
    assert entry.main(["compare", runs["a"], runs["c"]]) == 1  # the records agree: the samples do not
    out = capsys.readouterr().out
    assert "1 of 4 samples differ" in out and "cause: not the batch composition" in out
    (tmp_path / "b" / "determinism_samples_validate.json").rename(tmp_path / "b" / "determinism_samples_test.json")
    assert entry.main(["compare", runs["a"], runs["b"]]) == 0
    out = capsys.readouterr().out
    assert "per-sample record (test): only in this run" in out
    assert "per-sample record (validate): only in the reference" in out
