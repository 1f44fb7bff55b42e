"""WorkerSeedCallback in one process: model-randomness independence, num_workers invariance, bad input, the patch."""

import lightning as L
import pytest
import torch
from lightning.pytorch import seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

from lightning_determinism import DeterminismWarning, DeterministicSingleDeviceStrategy, WorkerSeedCallback, fingerprint
from tests.helpers.lightning_models import NoisyPoints, fit_streams, quiet_trainer


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
    from tests.helpers.lightning_models import StreamDataset

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


class _NoisyDropout(L.LightningModule):
    """Dropout in the model, noise drawn by every ``dataset[i]`` (NoisyPoints), 128 shuffled samples."""

    def __init__(self, batch_size: int, num_workers: int) -> None:
        super().__init__()
        self.batch_size, self.num_workers = batch_size, num_workers
        self.net = None

    def configure_model(self):
        if self.net is None:  # built under the strategy's seed
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.5), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def train_dataloader(self):
        return DataLoader(NoisyPoints(128), batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_noisy(out, batch_size, num_workers, ckpt=None):
    """3 epochs with per-sample seeds; a first 2-worker run writes a checkpoint every 3 steps (step=12.ckpt, ...)."""
    saving = num_workers == 2 and ckpt is None
    saves = [ModelCheckpoint(dirpath=out, every_n_train_steps=3, save_top_k=-1, filename="{step}")] if saving else []
    trainer = quiet_trainer(
        DeterministicSingleDeviceStrategy(seed=7, device="cpu"), 1, max_epochs=3, default_root_dir=str(out),
        callbacks=[WorkerSeedCallback(per_sample=True), *saves], enable_checkpointing=saving,
    )  # fmt: skip
    module = _NoisyDropout(batch_size, num_workers)
    trainer.fit(module, ckpt_path=ckpt)
    return fingerprint(module)


@pytest.fixture(scope="module")
def noisy_fingerprints(tmp_path_factory):
    """Each (batch size, num_workers) trained once; ``"resumed"``: the 2-worker run from step 12, in epoch 1."""
    root = tmp_path_factory.mktemp("noisy")
    out = {}
    for batch_size in (16, 15):
        for num_workers in (0, 1, 2):
            out[batch_size, num_workers] = _fit_noisy(root / f"{batch_size}-{num_workers}", batch_size, num_workers)
        ckpt = root / f"{batch_size}-2" / "step=12.ckpt"
        out[batch_size, "resumed"] = _fit_noisy(root / f"{batch_size}-resumed", batch_size, 2, ckpt)
    return out


# 16 divides the 128 samples: PyTorch's RandomSampler then draws a last, empty permutation only if its iterator is
# asked for one more index than there are, which a multi-process loader's prefetch does and one in-process does not.
@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
@pytest.mark.parametrize("batch_size", [16, 15])
@pytest.mark.parametrize("num_workers", [1, 2, "resumed"])
def test_per_sample_seeding_trains_the_same_bits_whatever_num_workers(noisy_fingerprints, batch_size, num_workers):
    assert noisy_fingerprints[batch_size, num_workers] == noisy_fingerprints[batch_size, 0]


@pytest.mark.parametrize(
    ("n", "num_samples", "replacement"), [(8, 8, False), (8, 16, False), (8, 12, False), (8, 64, True), (8, 40, True)]
)
def test_the_sampler_draws_as_torchs_and_nothing_past_its_last_index(n, num_samples, replacement):
    from torch.utils.data import RandomSampler

    from lightning_determinism.data.worker_seeding import _ExactRandomSampler

    def sampler():
        return RandomSampler(range(n), replacement, num_samples, generator=torch.Generator().manual_seed(5))

    ours, torchs = sampler(), sampler()
    ours.__class__ = _ExactRandomSampler
    indices = iter(torchs)
    expected = [next(indices) for _ in range(num_samples)]  # torch's, not asked past the end
    assert list(ours) == expected  # list() asks for one index more ...
    assert torch.equal(ours.generator.get_state(), torchs.generator.get_state())  # ... and draws nothing for it
