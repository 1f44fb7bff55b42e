"""DeterminismRecord on one process: how the seed was chosen, the user's keys kept, one callback, off by one flag."""

from types import SimpleNamespace

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, Logger
from lightning.pytorch.trainer.states import TrainerFn

from lightning_determinism import DeterminismRecord, DeterminismWarning, DeterministicSingleDeviceStrategy
from lightning_determinism.divergence.run_record import CHECKPOINT_KEY, differ_in, differences
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


def test_seed_everythings_seed_is_recorded_beside_the_strategys_and_a_difference_is_named(tmp_path):
    logged = {}
    for name, seed in (("a", 3), ("b", 4)):  # LightningCLI's `seed_everything:`, the strategy's seed the same
        L.seed_everything(seed, verbose=False)
        _, logged[name], _ = fit(tmp_path / name, DeterministicSingleDeviceStrategy(device="cpu", seed=11))
    assert (logged["a"]["determinism/seed"], logged["b"]["determinism/seed"]) == ("the user's", "the user's")
    assert logged["a"]["determinism/seed_source"] == "given"
    assert (logged["a"]["determinism/seed_everything"], logged["b"]["determinism/seed_everything"]) == (3, 4)
    differing = [key for key in differences(logged["a"], logged["b"]) if not key.startswith("determinism/fingerprint")]
    assert differ_in(differing) == ["seed_everything's seed"]


def test_log_record_false_logs_none_of_it(tmp_path):
    trainer, logged, checkpoint = fit(tmp_path, DeterministicSingleDeviceStrategy(device="cpu", log_record=False))
    assert not any(isinstance(cb, DeterminismRecord) for cb in trainer.callbacks)
    assert logged == {"lr": 0.5, "determinism/seed": "the user's"}
    assert CHECKPOINT_KEY not in checkpoint


def test_log_record_must_be_a_bool():
    with pytest.raises(TypeError, match=r"`log_record` must be a bool, got 'no'"):
        DeterministicSingleDeviceStrategy(device="cpu", log_record="no")


def test_a_save_during_validation_uses_the_sharded_fingerprint_taken_at_the_pass_start(tmp_path, monkeypatch):
    # A PreemptionCheckpoint saves during a validation pass on rank 0 alone: a sharded model's fingerprint (a
    # collective) must then be the one every rank took at the pass's start.
    import torch.distributed as dist
    from torch.distributed._composable.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_determinism import PreemptionCheckpoint, fingerprint
    from lightning_determinism.callbacks import determinism_record

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    model = torch.nn.Linear(2, 2)
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    expected = fingerprint(model)
    trainer = SimpleNamespace(
        state=SimpleNamespace(fn=TrainerFn.FITTING), sanity_checking=False, callbacks=[PreemptionCheckpoint()],
        training=False, global_rank=0, global_step=3, strategy=None, loggers=[],
    )  # fmt: skip
    record = DeterminismRecord()
    record.on_validation_start(trainer, model)

    def collective(*args):
        raise AssertionError("a collective during the pass")

    monkeypatch.setattr(determinism_record, "model_fingerprint", collective)
    checkpoint = {}
    record.on_save_checkpoint(trainer, model, checkpoint)
    assert checkpoint[CHECKPOINT_KEY] == {"fingerprint": expected, "global_step": 3}
    trainer.training = True  # a save in training is taken then, by every rank
    with pytest.raises(AssertionError, match="a collective during the pass"):
        record.on_save_checkpoint(trainer, model, {})


def test_the_record_holds_the_invariant_modes_b_m_and_k():
    from lightning_determinism.callbacks._record_entries import build_record, local_streams

    strategy = DeterministicSingleDeviceStrategy(
        device="cpu", debug_mode="warn", global_batch_size=8, micro_batch_size=2
    )
    record = build_record(strategy, [local_streams()], {"optimizer": "SGD", "world_size": 1}, "32-true")
    assert (record["determinism/invariant/global_batch_size"], record["determinism/invariant/micro_batch_size"],
            record["determinism/invariant/micro_batches_per_rank"]) == (8, 2, 4)  # fmt: skip
    assert record["determinism/debug_mode"] == "warn" and record["determinism/run/optimizer"] == "SGD"
    assert "determinism/run/world_size" not in record and record["determinism/world_size"] == 1


def test_two_saves_of_one_step_digest_the_model_once_and_the_end_of_fit_anew(monkeypatch):
    # ModelCheckpoint writes a top-k file and last.ckpt at one step: one digest of the whole model serves both; the
    # end of fit digests again (a callback such as SWA may have changed the weights at the end of training).
    from lightning_determinism.callbacks import determinism_record

    calls = []

    def counted(model, rank, state_dict=None):
        calls.append(1)
        return f"digest-{len(calls)}"

    monkeypatch.setattr(determinism_record, "model_fingerprint", counted)
    trainer = SimpleNamespace(training=True, global_rank=0, global_step=4, strategy=None, loggers=[object()])
    record, model = DeterminismRecord(), torch.nn.Linear(2, 2)
    monkeypatch.setattr(determinism_record, "log_fingerprint", lambda *args: None)
    first, second = {}, {}
    record.on_save_checkpoint(trainer, model, first)
    record.on_save_checkpoint(trainer, model, second)
    assert len(calls) == 1 and first[CHECKPOINT_KEY] == second[CHECKPOINT_KEY]
    record.on_train_batch_start(trainer, model, None, 0)  # the next step may change the weights
    trainer.global_step = 5
    record.on_save_checkpoint(trainer, model, {})
    record.on_fit_end(trainer, model)
    assert len(calls) == 3


class _WriteOnceLogger(Logger):
    """A logger that keeps a run's parameters as first logged, as MLflow does: a changed value is refused (the
    batch's earlier entries written, as MLflow's file store writes them); ``down``: it refuses everything."""

    def __init__(self, params: dict, down: bool = False) -> None:
        super().__init__()
        self.params, self.down = params, down

    @property
    def name(self):
        return "write-once"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs):
        if self.down:
            raise ConnectionError("tracking server unreachable")
        for key, value in _flatten(params).items():
            if key in self.params and self.params[key] != str(value):
                raise ValueError(f"Changing param values is not allowed: {key!r} was {self.params[key]!r}")
            self.params[key] = str(value)

    def log_metrics(self, metrics, step=None):
        pass


def _flatten(params):
    return params if isinstance(params, dict) else vars(params)


def _fit_into(tmp_path, params, max_epochs, ckpt_path=None, down=False):
    trainer = quiet_trainer(
        DeterministicSingleDeviceStrategy(device="cpu", seed=5), devices=1, max_epochs=max_epochs,
        logger=_WriteOnceLogger(params, down), enable_checkpointing=True, default_root_dir=str(tmp_path),
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)],
    )  # fmt: skip
    trainer.fit(RecordingModule(str(tmp_path), n=8), ckpt_path=ckpt_path)
    return trainer


def test_a_requeued_job_resuming_into_its_run_logs_what_changed_under_resume_n_and_trains_on(tmp_path):
    # MLflow's MLFlowLogger(run_id=...) of a requeued job: the same run's parameters, a longer fit resumed from last
    params = {}
    _fit_into(tmp_path, params, max_epochs=1)
    first = dict(params)
    for number, epochs in ((1, 2), (2, 3)):
        trainer = _fit_into(tmp_path, params, max_epochs=epochs, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
        assert trainer.current_epoch == epochs  # it trained on to the end
        assert params[f"determinism/resume_{number}/run/max_epochs"] == str(epochs)
        assert params[f"determinism/resume_{number}/fingerprint/final"] != params["determinism/fingerprint/final"]
    assert {key: params[key] for key in first} == first  # nothing first logged was touched
    assert not any(key.startswith("determinism/resume_3") for key in params)


def test_a_logger_that_refuses_everything_is_warned_about_and_training_goes_on(tmp_path):
    with pytest.warns(DeterminismWarning, match=r"_WriteOnceLogger refused .* \(tracking server unreachable\)"):
        trainer = _fit_into(tmp_path, {}, max_epochs=1, down=True)
    assert trainer.current_epoch == 1


def test_mlflow_resuming_into_the_same_run(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")  # not among the test extras: run where MLflow is installed
    from lightning.pytorch.loggers import MLFlowLogger

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's file store, kept for tests
    uri = f"file:{tmp_path / 'mlruns'}"

    def fit_run(max_epochs, run_id=None):
        logger = MLFlowLogger(tracking_uri=uri, run_id=run_id)
        trainer = quiet_trainer(
            DeterministicSingleDeviceStrategy(device="cpu", seed=5), devices=1, max_epochs=max_epochs, logger=logger,
            enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)],
        )  # fmt: skip
        last = tmp_path / "ckpt" / "last.ckpt"
        trainer.fit(RecordingModule(str(tmp_path), n=8), ckpt_path=str(last) if run_id else None)
        return logger.run_id

    run_id = fit_run(1)
    assert fit_run(2, run_id) == run_id
    params = mlflow.tracking.MlflowClient(uri).get_run(run_id).data.params
    assert params["determinism/run/max_epochs"] == "1" and params["determinism/resume_1/run/max_epochs"] == "2"


class _Evaluated(RecordingModule):
    def validation_step(self, batch, batch_idx):
        pass

    def test_step(self, batch, batch_idx):
        pass

    def predict_step(self, batch, batch_idx):
        return batch

    def val_dataloader(self):
        return self.train_dataloader()

    test_dataloader = predict_dataloader = val_dataloader


@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
def test_an_evaluation_run_on_its_own_logs_the_record_and_the_evaluated_weights_fingerprint(
    tmp_path, stage, capsys, monkeypatch
):
    import _lightning_determinism_cli as entry
    from lightning_determinism import fingerprint
    from lightning_determinism.seeding import isolation

    runs = {}
    for name, weight in (("a", 0.0), ("b", 0.0), ("c", 1.0)):  # c evaluates other weights
        # each as a script of its own (a second standalone pass in one process draws new numbers: seeding.isolation)
        monkeypatch.setattr(isolation, "_CALLS", {})
        torch.manual_seed(0)  # the same weights in a and b (built before the strategy seeds)
        module = _Evaluated(str(tmp_path / name), n=8)
        module.configure_model()
        torch.nn.init.constant_(next(module.parameters()), weight)
        trainer = quiet_trainer(DeterministicSingleDeviceStrategy(device="cpu", seed=5), devices=1,
                                logger=CSVLogger(tmp_path / name, name="csv", version=0))  # fmt: skip
        getattr(trainer, stage)(module)
        runs[name] = yaml.safe_load((tmp_path / name / "csv" / "version_0" / "hparams.yaml").read_text())
        assert runs[name]["determinism/fingerprint/final"] == fingerprint(module)
    assert runs["a"]["determinism/run/stage"] == stage and runs["a"]["determinism/seed"] == 5
    capsys.readouterr()
    assert entry.main(["compare", str(tmp_path / "a" / "csv"), str(tmp_path / "b" / "csv")]) == 0
    assert entry.main(["compare", str(tmp_path / "a" / "csv"), str(tmp_path / "c" / "csv")]) == 1
    assert "fingerprint at the end" in capsys.readouterr().out


def test_the_step_recorders_say_that_an_evaluation_run_records_no_steps(tmp_path):
    from lightning_determinism import DivergenceProbe, NumericalBaseline

    callbacks = [NumericalBaseline(tmp_path / "base.json"), DivergenceProbe(tmp_path / "probe.json")]
    trainer = quiet_trainer(DeterministicSingleDeviceStrategy(device="cpu", seed=5), devices=1, callbacks=callbacks)
    with pytest.warns(DeterminismWarning) as caught:
        trainer.validate(_Evaluated(str(tmp_path), n=8))
    said = [str(w.message) for w in caught if "records training steps" in str(w.message)]
    assert len(said) == 2 and all("Trainer.validate() records none" in line for line in said)
    assert not (tmp_path / "base.json").exists() and not (tmp_path / "probe.json").exists()
