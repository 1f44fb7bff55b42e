"""RNGStateCheckpoint policies in one process: missing state, another world size, malformed entries."""

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_determinism import DeterminismWarning, DeterministicSingleDeviceStrategy, RNGStateCheckpoint
from lightning_determinism.callbacks.rng_checkpoint import CHECKPOINT_KEY, checkpoint_rng_size
from tests.lightning_models import RecordingModule, quiet_trainer, read_records


def _fit(tmp_path, name, epochs, ckpt_path=None):
    out = tmp_path / name
    out.mkdir(parents=True, exist_ok=True)
    trainer = quiet_trainer(
        DeterministicSingleDeviceStrategy(seed=3),
        devices=1,
        max_epochs=epochs,
        callbacks=[ModelCheckpoint(dirpath=out, save_last=True)],
        enable_checkpointing=True,
    )
    trainer.fit(RecordingModule(str(out), record_draws=False), ckpt_path=ckpt_path)
    return out


@pytest.fixture
def first(tmp_path):
    return _fit(tmp_path, "first", 1) / "last.ckpt"


def _rewrite(path, tmp_path, edit):
    checkpoint = torch.load(path, weights_only=True)
    edit(checkpoint)
    new = tmp_path / "edited.ckpt"
    torch.save(checkpoint, new)
    return new


def test_single_process_resume_is_bitwise(tmp_path, first):
    straight = read_records(_fit(tmp_path, "straight", 2), 1)[0]
    resumed = read_records(_fit(tmp_path, "resumed", 2, first), 1)[0]
    assert resumed["final_digest"] == straight["final_digest"]
    assert resumed["dropout"] == straight["dropout"][-len(resumed["dropout"]) :]


def test_missing_rng_state_warns_and_goes_on(tmp_path, first):
    path = _rewrite(first, tmp_path, lambda c: c.pop(CHECKPOINT_KEY))
    with pytest.warns(DeterminismWarning, match="holds no RNG state"):
        _fit(tmp_path, "resumed", 2, path)


def test_other_world_size_rederives_and_stays_reproducible(tmp_path, first):
    def pretend_two_ranks(checkpoint):
        entry = checkpoint[CHECKPOINT_KEY]
        entry["ranks"] = entry["ranks"] * 2
        entry["world_size"] = 2

    path = _rewrite(first, tmp_path, pretend_two_ranks)
    digests = []
    for name in ("a", "b"):
        with pytest.warns(DeterminismWarning, match="written by 2 ranks and is resumed on 1"):
            digests.append(read_records(_fit(tmp_path, name, 2, path), 1)[0]["final_digest"])
    assert digests[0] == digests[1]


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda c: c[CHECKPOINT_KEY].pop("ranks"), r"`lightning_determinism_rng` is malformed: missing 'ranks'"),
        (
            lambda c: c[CHECKPOINT_KEY]["ranks"][0]["rng"].pop("torch"),
            r"ranks\[0\]\.rng` is malformed: missing 'torch'",
        ),
        (
            lambda c: c[CHECKPOINT_KEY]["ranks"].append({}),
            r"`lightning_determinism_rng.ranks` is malformed: expected 1",
        ),
    ],
)
def test_malformed_entries_name_the_key(tmp_path, first, edit, match):
    path = _rewrite(first, tmp_path, edit)
    with pytest.raises(ValueError, match=match):
        _fit(tmp_path, "resumed", 2, path)


def test_size_of_the_entry(first):
    checkpoint = torch.load(first, weights_only=True)
    size = checkpoint_rng_size(checkpoint)
    assert 5_000 < size < 50_000  # python (625 x 8 B) + numpy (624 x 8 B) + torch CPU (5056 B) per rank
    assert RNGStateCheckpoint().state_key == "RNGStateCheckpoint"


def test_a_checkpoint_from_another_base_seed_warns_naming_both(tmp_path, first):
    def other_seed(checkpoint):
        checkpoint[CHECKPOINT_KEY]["base_seed"] = 99

    path = _rewrite(first, tmp_path, other_seed)
    with pytest.warns(DeterminismWarning, match=r"base seed 99, but this run's base seed is 3.*Resume with seed=99"):
        _fit(tmp_path, "resumed", 2, path)


def test_the_checkpoint_records_the_report_of_the_run(first):
    saved = torch.load(first, weights_only=True)[CHECKPOINT_KEY]
    assert saved["report"]["base_seed"] == 3 and saved["report"]["deterministic_algorithms"] is True
