"""DeterminismRecord on one process: how the seed was chosen, the user's keys kept, one callback, off by one flag."""

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_determinism import DeterminismRecord, DeterministicSingleDeviceStrategy
from lightning_determinism.divergence.run_record import CHECKPOINT_KEY
from tests.helpers.lightning_models import RecordingModule, quiet_trainer


class UserKeys(RecordingModule):
    def __init__(self, out_dir: str) -> None:
        super().__init__(out_dir, n=8)
        # A user's hyperparameter that happens to carry one of the record's names: the user's value is logged.
        self.save_hyperparameters({"lr": 0.5, "determinism/seed": "the user's"})


def fit(tmp_path, strategy, callbacks=()):
    trainer = quiet_trainer(
        strategy, devices=1, max_epochs=1, logger=CSVLogger(tmp_path, name="csv", version=0),
        callbacks=[*callbacks, ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="last")],
        enable_checkpointing=True, default_root_dir=str(tmp_path),
    )  # fmt: skip
    trainer.fit(UserKeys(str(tmp_path)))
    logged = yaml.safe_load((tmp_path / "csv" / "version_0" / "hparams.yaml").read_text())
    return trainer, logged, torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)


def test_seed_everything_and_the_topology_are_said_the_users_keys_win_and_a_users_callback_is_the_only_one(tmp_path):
    L.seed_everything(77, verbose=False)
    mine = DeterminismRecord()
    strategy = DeterministicSingleDeviceStrategy(device="cpu", topology={"mp_degree": 1})
    trainer, logged, checkpoint = fit(tmp_path, strategy, [mine])
    assert [cb for cb in trainer.callbacks if isinstance(cb, DeterminismRecord)] == [mine]
    assert logged["determinism/seed_source"] == "seed_everything"
    assert logged["determinism/rank_0/local_seed"] == strategy.local_seed != 77  # the topology's stream seed
    assert (logged["determinism/topology/dp"], logged["determinism/topology/mp"]) == (1, 1)
    assert logged["determinism/seed"] == "the user's" and logged["lr"] == 0.5
    assert logged["determinism/fingerprint/final"] == checkpoint[CHECKPOINT_KEY]["fingerprint"]


def test_log_record_false_logs_none_of_it(tmp_path):
    trainer, logged, checkpoint = fit(tmp_path, DeterministicSingleDeviceStrategy(device="cpu", log_record=False))
    assert not any(isinstance(cb, DeterminismRecord) for cb in trainer.callbacks)
    assert logged == {"lr": 0.5, "determinism/seed": "the user's"}
    assert CHECKPOINT_KEY not in checkpoint


def test_log_record_must_be_a_bool():
    with pytest.raises(TypeError, match=r"`log_record` must be a bool, got 'no'"):
        DeterministicSingleDeviceStrategy(device="cpu", log_record="no")
