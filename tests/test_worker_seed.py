"""WorkerSeedCallback in one process: model-randomness independence, bad input, the strategy patch."""

import pytest
import torch
from lightning.pytorch import seed_everything

from lightning_determinism import DeterminismWarning, WorkerSeedCallback
from tests.lightning_models import fit_streams


def _batches(samples):
    return [(s["epoch"], s["index"], s["torch"], s["numpy"], s["python"]) for s in samples]


@pytest.mark.parametrize(("num_workers", "per_sample"), [(2, False), (0, True), (2, True)])
def test_data_stream_ignores_how_much_randomness_the_model_draws(tmp_path, num_workers, per_sample):
    runs = {}
    for dropout in (0.0, 0.5):
        seed_everything(11, verbose=False)
        samples, _ = fit_streams(
            "auto",
            tmp_path / f"{dropout}",
            [WorkerSeedCallback(per_sample=per_sample)],
            devices=1,
            num_workers=num_workers,
            dropout=dropout,
        )
        runs[dropout] = _batches(samples)
    assert runs[0.0] == runs[0.5]


def test_in_process_loading_keeps_the_order_but_shares_the_model_rng(tmp_path):
    # num_workers=0 without per_sample: __getitem__ runs in the training process and draws from the same global
    # RNG as the model, so only the order (the loader's own generator) is protected. This is documented.
    runs = {}
    for dropout in (0.0, 0.5):
        seed_everything(11, verbose=False)
        samples, _ = fit_streams(
            "auto", tmp_path / f"{dropout}", [WorkerSeedCallback()], devices=1, num_workers=0, dropout=dropout
        )
        runs[dropout] = samples
    assert [(s["epoch"], s["index"]) for s in runs[0.0]] == [(s["epoch"], s["index"]) for s in runs[0.5]]
    assert _batches(runs[0.0]) != _batches(runs[0.5])


def test_without_the_callback_dropout_changes_the_data(tmp_path):
    runs = {}
    for dropout in (0.0, 0.5):
        seed_everything(11, verbose=False)
        samples, _ = fit_streams("auto", tmp_path / f"{dropout}", [], devices=1, num_workers=2, dropout=dropout)
        runs[dropout] = _batches(samples)
    assert runs[0.0] != runs[0.5]  # what the callback fixes


def test_users_generator_is_respected():
    from torch.utils.data import DataLoader

    from lightning_determinism.data.worker_seeding import LoaderSeeding
    from tests.lightning_models import StreamDataset

    generator = torch.Generator().manual_seed(77)
    loader = DataLoader(StreamDataset(4), batch_size=2, shuffle=True, generator=generator)
    assert LoaderSeeding(base_seed=1, rank=0, per_sample=False).prepare(loader, "train") is loader
    assert loader.generator is generator
    assert loader.sampler.generator is generator
    own = DataLoader(StreamDataset(4), batch_size=2, shuffle=True)
    LoaderSeeding(base_seed=1, rank=0, per_sample=False).prepare(own, "train")
    assert own.generator is not None and own.sampler.generator is not None  # the contrast: a loader without one


def test_non_dataloader_iterable_warns_once_and_is_left_alone(tmp_path):
    seed_everything(1, verbose=False)
    with pytest.warns(DeterminismWarning, match="leaves a `PlainBatches` alone") as record:
        fit_streams("auto", tmp_path, [WorkerSeedCallback()], devices=1, epochs=2, loaders="list-of-batches")
    assert sum("leaves a `PlainBatches` alone" in str(w.message) for w in record) == 1


@pytest.mark.parametrize(("seed", "error"), [(-1, ValueError), (2**32, ValueError), (0.5, TypeError), ("3", TypeError)])
def test_bad_seed(seed, error):
    with pytest.raises(error, match="`seed`"):
        WorkerSeedCallback(seed=seed)


def test_bad_per_sample():
    with pytest.raises(TypeError, match="`per_sample` must be a bool, got 'yes'"):
        WorkerSeedCallback(per_sample="yes")


def test_no_seed_anywhere_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    with pytest.raises(RuntimeError, match=r"WorkerSeedCallback has no seed: pass `WorkerSeedCallback\(seed=...\)`"):
        fit_streams("auto", tmp_path, [WorkerSeedCallback()], devices=1, num_workers=0)


def test_strategy_patch_is_removed_after_the_run(tmp_path):
    _, trainer = fit_streams("auto", tmp_path, [WorkerSeedCallback(seed=4)], devices=1, num_workers=0, epochs=1)
    assert "process_dataloader" not in vars(trainer.strategy)
