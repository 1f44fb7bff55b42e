"""The determinism record in a Fabric loop (one process): logged through fabric.loggers, fingerprints at fabric.save
and at the end, and the environment the strategy set restored when the launched function returns."""

import os

import lightning as L
import pytest
import torch
import yaml
from lightning.fabric.loggers import CSVLogger, TensorBoardLogger
from torch import nn

import _lightning_determinism_cli as entry
from lightning_determinism import (
    DeterministicFabricSingleDeviceStrategy,
    fingerprint,
    log_determinism_record,
    log_fingerprint,
)
from lightning_determinism.divergence._event_file import read_event_file
from lightning_determinism.divergence.run_record import CHECKPOINT_KEY

ENV = ("PL_GLOBAL_SEED", "LDET_BASE_SEED", "LDET_LOCAL_SEED")


def train(fabric, out):
    model = fabric.setup(nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 1)))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    record = log_determinism_record(fabric)
    seen_env = {key: os.environ.get(key) for key in ENV}
    for step in (1, 2):
        fabric.backward(model(torch.ones(2, 3)).sum())
        optimizer.step()
        optimizer.zero_grad()
        fabric.save(out / f"step{step}.ckpt", {"model": model, "optimizer": optimizer, "step": step})
    return record, seen_env, log_fingerprint(fabric, model, 2, final=True)


def run(out, seed):
    strategy = DeterministicFabricSingleDeviceStrategy(seed=seed, device="cpu")
    loggers = [CSVLogger(out, name="csv", version=0), TensorBoardLogger(out, name="tb", version=0)]
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy, loggers=loggers)
    return fabric.launch(train, out)


def test_a_fabric_loop_logs_the_record_and_its_fingerprints_and_leaves_no_seed_behind(tmp_path, monkeypatch):
    for key in ENV:
        monkeypatch.delenv(key, raising=False)
    record, seen_env, final = run(tmp_path / "a", 3)
    assert seen_env == {"PL_GLOBAL_SEED": "3", "LDET_BASE_SEED": "3", "LDET_LOCAL_SEED": "3"}  # during the run
    assert not any(key in os.environ for key in ENV)  # ... and nothing of it after fabric.launch(train) returned
    assert record["determinism/seed"] == 3 and record["determinism/precision"] == "32-true"
    csv = yaml.safe_load((tmp_path / "a" / "csv" / "version_0" / "hparams.yaml").read_text())
    (events,) = (tmp_path / "a" / "tb" / "version_0").glob("events.out.tfevents.*")
    hparams, texts = read_event_file(events)
    assert csv["determinism/seed"] == hparams["determinism/seed"] == 3
    for step in (1, 2):
        checkpoint = torch.load(tmp_path / "a" / f"step{step}.ckpt", weights_only=True)
        value = checkpoint[CHECKPOINT_KEY]["fingerprint"]
        assert value == fingerprint(checkpoint["model"])  # the saved weights' own
        assert csv[f"determinism/fingerprint/step_{step}"] == value
        assert (step, "determinism/fingerprint", value) in texts
    assert final == value == csv["determinism/fingerprint/final"]
    run(tmp_path / "b", 4)
    assert entry.main(["compare", str(tmp_path / "a" / "csv"), str(tmp_path / "b" / "tb")]) == 1


def test_log_fingerprint_refuses_a_bad_step():
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=DeterministicFabricSingleDeviceStrategy(seed=1))
    with pytest.raises(ValueError, match=r"`step` must be an int >= 0, got -1"):
        log_fingerprint(fabric, nn.Linear(1, 1), -1)


def _rank(fabric):
    return fabric.global_rank


@pytest.mark.distributed
def test_a_forked_fabric_launch_gives_the_launching_process_its_environment_back(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    with monkeypatch.context() as cuda:
        cuda.setattr(torch.cuda, "is_available", lambda: True)  # where CUDA is: set for the ranks to inherit
        fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp_fork_deterministic")
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert fabric.launch(_rank) == 0
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    with pytest.raises(TypeError, match="needs to be called with a function"):  # Fabric still tells fork by class
        fabric.launch()
