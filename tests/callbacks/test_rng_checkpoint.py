"""RNGStateCheckpoint policies in one process: missing state, another world size, malformed entries."""

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_determinism import DeterminismWarning, DeterministicSingleDeviceStrategy, RNGStateCheckpoint
from lightning_determinism.callbacks.rng_checkpoint import CHECKPOINT_KEY, checkpoint_rng_size
from tests.helpers.lightning_models import RecordingModule, quiet_trainer, read_records


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


@pytest.mark.parametrize("identity", [True, False], ids=["identity", "older-checkpoint"])
def test_a_checkpoint_from_another_base_seed_warns_naming_both(tmp_path, first, identity):
    def other_seed(checkpoint):
        checkpoint[CHECKPOINT_KEY]["base_seed"] = 99
        if identity:
            checkpoint[CHECKPOINT_KEY]["identity"]["base_seed"] = 99
        else:
            del checkpoint[CHECKPOINT_KEY]["identity"]

    path = _rewrite(first, tmp_path, other_seed)
    match = "base_seed: 99 -> 3 .*resume with seed=99" if identity else "base seed 99, but this run's base seed is 3"
    with pytest.warns(DeterminismWarning, match=match):  # at an epoch boundary: said (mid-epoch: refused)
        _fit(tmp_path, "resumed", 2, path)


def test_the_checkpoint_records_the_report_of_the_run(first):
    saved = torch.load(first, weights_only=True)[CHECKPOINT_KEY]
    assert saved["report"]["base_seed"] == 3 and saved["report"]["deterministic_algorithms"] is True


class _Accumulating(RecordingModule):
    def __init__(self, out_dir, fail_at=None):
        super().__init__(out_dir, n=24, record_draws=False)
        self.fail_at = fail_at

    def training_step(self, batch, batch_idx):
        if batch_idx == self.fail_at:
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)


class _SaveAfterFirstMicroBatch(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 0:
            trainer.save_checkpoint(Path(pl_module.out_dir) / "mid.ckpt")


def test_a_checkpoint_between_micro_batches_is_refused_with_what_to_do(tmp_path):
    trainer = quiet_trainer(
        DeterministicSingleDeviceStrategy(seed=3),
        1,
        max_epochs=1,
        accumulate_grad_batches=2,
        callbacks=[_SaveAfterFirstMicroBatch()],
    )
    with pytest.raises(RuntimeError, match=r"holds no accumulated gradients.*every_n_train_steps"):
        trainer.fit(_Accumulating(str(tmp_path)))
    assert not (tmp_path / "mid.ckpt").exists()


def test_on_an_exception_the_mid_accumulation_checkpoint_is_written_with_a_warning(tmp_path):
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    trainer = quiet_trainer(
        DeterministicSingleDeviceStrategy(seed=3),
        1,
        max_epochs=1,
        accumulate_grad_batches=2,
        callbacks=[OnExceptionCheckpoint(tmp_path)],
        enable_checkpointing=True,
    )
    with (
        pytest.warns(DeterminismWarning, match="holds no accumulated gradients"),
        pytest.raises(RuntimeError, match="boom"),
    ):
        trainer.fit(_Accumulating(str(tmp_path), fail_at=3))
    assert (tmp_path / "on_exception.ckpt").exists()  # no data lost


def _fit_stream_module(tmp_path, name, epochs, ckpt=None, **module):
    """StreamModule on 1 process, 2 workers, 8 steps per epoch; a checkpoint every 3 steps: step=3.ckpt, ..."""
    from tests.helpers.lightning_models import StreamModule

    out = tmp_path / name
    out.mkdir()
    trainer = quiet_trainer(
        DeterministicSingleDeviceStrategy(seed=3),
        1,
        max_epochs=epochs,
        callbacks=[ModelCheckpoint(dirpath=out, every_n_train_steps=3, save_top_k=-1, filename="{step}")],
        enable_checkpointing=True,
    )
    trainer.fit(StreamModule(str(out), n=16, batch_size=2, num_workers=2, **module), ckpt_path=ckpt)
    return out, json.loads((out / "samples-rank0.json").read_text())


def test_resuming_mid_epoch_with_workers_and_per_worker_seeds_replays_their_draws(tmp_path):
    first, straight = _fit_stream_module(tmp_path, "straight", 1)
    _, resumed = _fit_stream_module(tmp_path, "resumed", 1, ckpt=first / "step=3.ckpt")
    process = ("worker", "torch_seed", "pytorch_worker_seed")  # which worker process served a sample, not its draws

    def drawn(samples):
        return [{k: v for k, v in s.items() if k not in process} for s in samples]

    assert drawn(resumed) == drawn(straight[3 * 2 :])
    assert [s["worker"] for s in resumed] != [s["worker"] for s in straight[3 * 2 :]]  # other workers took the roles


def test_resuming_persistent_workers_past_their_first_epoch_without_per_sample_seeding_warns(tmp_path):
    first, _ = _fit_stream_module(tmp_path, "first", 2, persistent_workers=True)
    with pytest.warns(DeterminismWarning, match="Resuming mid-epoch with persistent data-loader workers"):
        _fit_stream_module(tmp_path, "resumed", 2, ckpt=first / "step=9.ckpt", persistent_workers=True)  # epoch 1


def test_torchdata_stateful_loader_is_refused_with_the_reason():
    from torch.utils.data import DataLoader

    from lightning_determinism.data.resumable import make_resumable

    fake = type(
        "StatefulDataLoader", (DataLoader,), {"__module__": "torchdata.stateful_dataloader.stateful_dataloader"}
    )
    with pytest.raises(RuntimeError, match=r"StatefulDataLoader is not supported.*overlap.*epoch 0's order"):
        make_resumable(fake(list(range(4))), None)


def test_the_real_torchdata_loader_is_refused_at_setup(tmp_path):
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    from tests.helpers.lightning_models import IndexDataset

    module = RecordingModule(str(tmp_path), record_draws=False)
    module.train_dataloader = lambda: stateful.StatefulDataLoader(IndexDataset(8), batch_size=2, shuffle=True)
    trainer = quiet_trainer(DeterministicSingleDeviceStrategy(seed=3), 1, max_epochs=1)
    with pytest.raises(RuntimeError, match="StatefulDataLoader is not supported"):
        trainer.fit(module)


def test_the_step_boundary_hook_pickles_and_deep_copies_with_its_callback():
    # Spawn launchers pickle the trainer's callbacks; users deep-copy them.
    import copy
    import pickle

    from lightning_determinism.callbacks._step_boundaries import AfterOptimizerSteps, save_at_step_boundaries

    callback = ModelCheckpoint(every_n_train_steps=1)
    save_at_step_boundaries(callback)
    hook = callback.on_train_batch_end
    save_at_step_boundaries(callback)  # once
    assert callback.on_train_batch_end is hook and isinstance(hook, AfterOptimizerSteps)
    for other in (pickle.loads(pickle.dumps(callback)), copy.deepcopy(callback)):
        assert isinstance(other.on_train_batch_end, AfterOptimizerSteps)
        assert other.on_train_batch_end.callback is other  # its own callback, not the original's


def test_the_model_parallel_strategy_and_the_replica_guard_pickle():
    import pickle

    from lightning_determinism import DeterministicModelParallelStrategy, ReplicaGuard

    strategy = pickle.loads(pickle.dumps(DeterministicModelParallelStrategy(seed=4, start_method="spawn")))
    assert (strategy.seed, strategy.start_method) == (4, "spawn")
    assert pickle.loads(pickle.dumps(ReplicaGuard(7))).every_n_train_steps == 7
