"""The determinism record in real loggers: two 2-process fits (seeds 1 and 2) with a CSVLogger and a TensorBoardLogger
each, a checkpoint every 2 steps; the record read back from hparams.yaml and the event file, the fingerprints from the
checkpoints, and `compare` on the loggers' directories telling the two runs apart."""

import json

import pytest
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

import _lightning_determinism_cli as entry
from lightning_determinism import DeterministicDDPStrategy, fingerprint

# A writer imported here once, not again in each fit's forked rank 0; a machine with neither skips the module.
try:
    import tensorboardX.summary  # noqa: F401
except ImportError:
    pytest.importorskip("torch.utils.tensorboard", reason="TensorBoardLogger needs tensorboardX or tensorboard")
from lightning_determinism.callbacks._record_entries import local_streams
from lightning_determinism.divergence._event_file import read_event_file, session_hparams
from lightning_determinism.divergence.run_record import CHECKPOINT_KEY, canonical, differences, record_of
from lightning_determinism.seeding.seeds import seed_all
from tests.helpers.lightning_models import RecordingModule, quiet_trainer

pytestmark = pytest.mark.distributed

SEEDS = {"a": 1, "b": 2}


class LoggedModule(RecordingModule):
    def __init__(self, out_dir: str, n: int = 16) -> None:
        super().__init__(out_dir, n=n)
        self.save_hyperparameters("n")  # the user's own hyperparameter, beside the record


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("record")
    for name, seed in SEEDS.items():
        out = root / name
        checkpoints = ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=2, save_top_k=-1, filename="{step}")
        loggers = [CSVLogger(out, name="csv", version=0), TensorBoardLogger(out, name="tb", version=0)]
        trainer = quiet_trainer(
            DeterministicDDPStrategy(seed=seed, start_method="fork"), max_epochs=2, logger=loggers,
            callbacks=[checkpoints], enable_checkpointing=True, default_root_dir=str(out),
        )  # fmt: skip
        trainer.fit(LoggedModule(str(out)))  # 16 samples, 2 ranks x 4: 2 steps an epoch, 4 in all
    return root


def csv_record(root, name):
    return yaml.safe_load((root / name / "csv" / "version_0" / "hparams.yaml").read_text())


def event_file(root, name):
    (path,) = (root / name / "tb" / "version_0").glob("events.out.tfevents.*")
    return path


def test_the_record_is_in_hparams_yaml_and_in_the_event_file(runs):
    for name, seed in SEEDS.items():
        tb, _ = read_event_file(event_file(runs, name))
        for record in (csv_record(runs, name), tb):
            assert record["n"] == 16  # the user's own, kept
            assert record["determinism/seed"] == seed and record["determinism/seed_source"] == "given"
            assert record["determinism/debug_mode"] == "error" and record["determinism/world_size"] == 2
            # tensorboardX keeps a bool; torch's writer (with `tensorboard` installed) gives it back as 1.0
            assert canonical(record["determinism/backend/deterministic_algorithms"]) in (True, 1)
            assert record["determinism/backend/deterministic_algorithms"] in (True, 1.0)
            assert record["determinism/version/torch"] == str(torch.__version__)
            assert record["determinism/strategy"] == "DeterministicDDPStrategy"
            assert record["determinism/run/optimizer"] == "SGD" and record["determinism/run/optimizer.lr"] == 0.1
            assert record["determinism/run/train_samples"] == 16  # known from on_train_start: logged then
            assert record["determinism/streams/equal_ranks"] == "[[0], [1]]"
            for rank in range(2):
                seed_all(seed + rank)  # what the rank's streams were seeded with at the start of fit
                assert record[f"determinism/rank_{rank}/cpu"] == local_streams()["cpu"]
                assert record[f"determinism/rank_{rank}/local_seed"] == seed + rank
        # One record, two writers: compare finds no difference between what each gave back (the fingerprints are
        # the event file's text entries, checked below).
        csv = {
            k: v for k, v in record_of(csv_record(runs, name)).items() if not k.startswith("determinism/fingerprint")
        }
        assert differences(csv, record_of(tb)) == {}
        # TensorBoard's HParams tab shows a run's first set: the user's and the record's are in it together.
        first = session_hparams(event_file(runs, name))[0]
        assert first["n"] == 16 and first["determinism/seed"] == seed


def test_every_checkpoint_holds_the_fingerprint_the_loggers_show(runs):
    for name in SEEDS:
        csv = csv_record(runs, name)
        texts = {(step, tag): text for step, tag, text in read_event_file(event_file(runs, name))[1]}
        for step in (2, 4):
            checkpoint = torch.load(runs / name / "ckpt" / f"step={step}.ckpt", weights_only=True)
            value = checkpoint[CHECKPOINT_KEY]["fingerprint"]
            assert checkpoint[CHECKPOINT_KEY]["global_step"] == step
            assert value == fingerprint(checkpoint["state_dict"])  # the saved weights' own
            assert csv[f"determinism/fingerprint/step_{step}"] == value
            assert texts[(step, "determinism/fingerprint")] == value
        assert csv["determinism/fingerprint/final"] == value == texts[(4, "determinism/fingerprint/final")]
    assert csv_record(runs, "a")["determinism/fingerprint/step_2"] != csv["determinism/fingerprint/step_2"]


def test_compare_tells_the_two_seeds_apart_on_the_loggers_directories(runs, capsys):
    assert entry.main(["compare", str(runs / "a" / "csv"), str(runs / "b" / "tb")]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == (
        "these two runs differ in: seed, the ranks' random streams, fingerprint at steps 2, 4 and at the end"
    )
    # One run's CSV and TensorBoard records agree (numbers read back as floats, texts as hyperparameters).
    assert entry.main(["compare", str(runs / "a" / "csv"), str(runs / "a" / "tb" / "version_0"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["runs"][0]["differences"] == {}
    assert entry.main(["report", str(runs / "b" / "tb")]) == 0
    assert "  seed " in capsys.readouterr().out
    assert entry.main(["report", str(runs / "a" / "ckpt" / "step=4.ckpt"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fingerprint"] == csv_record(runs, "a")["determinism/fingerprint/final"]
    # A run's directory with both loggers' logs reads as that run; one that holds both runs is refused.
    assert entry.main(["compare", str(runs / "a"), str(runs / "b")]) == 1
    assert "these two runs differ in: seed," in capsys.readouterr().out
    assert entry.main(["compare", str(runs), str(runs / "b")]) == 2
    assert "holds the logs of 4 runs whose records differ" in capsys.readouterr().err
