"""Evaluation never changes training: fits that differ only in how often they validate, in sanity checking or in a
callback that draws random numbers while evaluating give one set of trained weights under the deterministic
strategies (1 and 2 processes) — and, as the reference that shows the test can fail, different ones under stock
Lightning (issue #16827). Evaluation itself draws reproducible numbers, different on each rank."""

from __future__ import annotations

import json
import random
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_determinism import DeterministicDDPStrategy, DeterministicSingleDeviceStrategy, fingerprint
from lightning_determinism.seeding.isolation import _StreamKeepingLoad
from tests.helpers.lightning_models import quiet_trainer


def _data(n: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 6, generator=gen), torch.randn(n, 1, generator=gen))


class Noisy(L.LightningModule):
    """Dropout in training, a shuffled loader that draws its order from the global generator, and an evaluation
    that draws from python, numpy and torch (test-time noise) and writes what it drew."""

    def __init__(self, out: str, val_workers: int = 0) -> None:
        super().__init__()
        self.out, self.val_workers = out, val_workers
        self.net = None
        self.drawn: list[float] = []

    def configure_model(self):
        if self.net is None:  # built under the run's seed (stock: seed_everything, ours: the base seed)
            self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        noise = torch.randn_like(x) * 0.01 + float(np.random.rand()) * 0.0 + random.random() * 0.0
        self.drawn.append(float(noise.sum()))
        self.log("val_loss", nn.functional.mse_loss(self.net(x + noise), y))

    test_step = validation_step

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0] + torch.randn_like(batch[0]))

    def train_dataloader(self):
        return DataLoader(_data(32, 0), batch_size=4, shuffle=True)

    def val_dataloader(self):
        return DataLoader(_data(12, 1), batch_size=4, num_workers=self.val_workers)

    test_dataloader = predict_dataloader = val_dataloader

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def on_train_end(self):
        record = {"weights": fingerprint(self.net), "drawn": self.drawn}
        (Path(self.out) / f"rank{self.global_rank}.json").write_text(json.dumps(record))


class DrawingLogger(L.Callback):
    """A logging callback that picks samples to show at random: in evaluation hooks only."""

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        torch.randint(0, 4, (3,)), np.random.randint(4), random.randrange(4)

    def on_validation_epoch_end(self, trainer, pl_module):
        torch.rand(5)


# name: (Trainer arguments, callbacks, validate/test/predict before fit, validation workers)
SCHEDULES = {
    "never": ({"limit_val_batches": 0, "num_sanity_val_steps": 0}, False, False, 0),
    "every-epoch-with-sanity": ({"num_sanity_val_steps": 2}, False, False, 0),
    "every-3-steps-2-batches": ({"val_check_interval": 3, "limit_val_batches": 2, "num_sanity_val_steps": 0}, False,
                                False, 0),
    "drawing-callback-evaluation-first": ({"num_sanity_val_steps": 1}, True, True, 2),
}  # fmt: skip


def _run(out: Path, strategy, devices: int, schedule: str) -> list[dict]:
    kwargs, callback, evaluate_first, workers = SCHEDULES[schedule]
    out.mkdir(parents=True)
    trainer = quiet_trainer(strategy, devices, max_epochs=2, callbacks=[DrawingLogger()] if callback else [], **kwargs)
    model = Noisy(str(out), val_workers=workers)
    if evaluate_first:
        trainer.validate(model, verbose=False)
        trainer.test(model, verbose=False)
        trainer.predict(model)
        model.drawn.clear()
    trainer.fit(model)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(devices)]


def _ours(devices: int):
    if devices == 1:
        return DeterministicSingleDeviceStrategy(seed=3)
    return DeterministicDDPStrategy(seed=3, start_method="fork")


def _stock(devices: int):
    L.seed_everything(3, verbose=False)
    return SingleDeviceStrategy(device="cpu") if devices == 1 else DDPStrategy(start_method="fork")


@pytest.fixture(scope="module")
def fits(tmp_path_factory):
    root = tmp_path_factory.mktemp("isolation")
    runs = {}
    for devices in (1, 2):
        for name in SCHEDULES:
            runs["ours", devices, name] = _run(root / f"ours-{devices}-{name}", _ours(devices), devices, name)
        for name in ("never", "every-3-steps-2-batches"):
            runs["stock", devices, name] = _run(root / f"stock-{devices}-{name}", _stock(devices), devices, name)
    return runs


@pytest.mark.distributed
@pytest.mark.parametrize("devices", [1, 2])
def test_validation_frequency_sanity_checks_and_drawing_callbacks_leave_training_alone(fits, devices):
    weights = {name: [r["weights"] for r in fits["ours", devices, name]] for name in SCHEDULES}
    assert len({w for ranks in weights.values() for w in ranks}) == 1, weights


@pytest.mark.distributed
@pytest.mark.parametrize("devices", [1, 2])
def test_stock_lightning_lets_validation_change_the_weights(fits, devices):
    # Lightning #16827, as stock Lightning behaves today: this assertion fails the day Lightning fixes it.
    never, often = (fits["stock", devices, name][0]["weights"] for name in ("never", "every-3-steps-2-batches"))
    assert never != often


@pytest.mark.distributed
def test_evaluation_draws_are_reproducible_and_differ_by_rank(fits, tmp_path):
    first = fits["ours", 2, "every-3-steps-2-batches"]
    again = _run(tmp_path / "again", _ours(2), 2, "every-3-steps-2-batches")
    assert [r["drawn"] for r in first] == [r["drawn"] for r in again]
    assert first[0]["drawn"] != first[1]["drawn"]  # each rank its own evaluation stream
    passes = first[0]["drawn"]
    assert len(passes) == 2 * 1 * 2 and len(set(passes)) == len(passes)  # 2 epochs x 1 pass (step 3 of 4) x 2 batches


def test_load_from_checkpoint_inside_a_run_leaves_the_streams_alone(tmp_path):
    class Teacher(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(64, 64)  # initialising it draws from the global generator

    path = tmp_path / "teacher.ckpt"
    torch.save({"state_dict": Teacher().state_dict(), "pytorch-lightning_version": L.__version__}, path)

    class LoadsATeacher(L.Callback):
        def on_train_start(self, trainer, pl_module):
            Teacher.load_from_checkpoint(path)

    def fit(callbacks, strategy):
        out = tmp_path / f"run{len(list(tmp_path.glob('run*')))}"
        out.mkdir()
        trainer = quiet_trainer(strategy, 1, max_epochs=1, limit_val_batches=0, callbacks=callbacks)
        trainer.fit(Noisy(str(out)))
        return json.loads((out / "rank0.json").read_text())["weights"]

    assert fit([LoadsATeacher()], DeterministicSingleDeviceStrategy(seed=3)) == fit([], _ours(1))
    # Lightning #20204, stock: loading the teacher moved the training stream.
    assert fit([LoadsATeacher()], _stock(1)) != fit([], _stock(1))
    assert not isinstance(vars(L.LightningModule)["load_from_checkpoint"], _StreamKeepingLoad)  # unwrapped again


@pytest.mark.distributed
@pytest.mark.parametrize("devices", [1, 2])
def test_a_checkpoint_written_at_the_end_of_a_validation_pass_resumes_bitwise(tmp_path, devices):
    # ModelCheckpoint saves inside the validation pass (on_validation_end), while the evaluation streams are active:
    # the checkpoint must hold the training streams.
    def fit(out, ckpt=None):
        out.mkdir(parents=True)
        every_pass = ModelCheckpoint(dirpath=out, save_top_k=-1, filename="{step}")
        trainer = quiet_trainer(
            _ours(devices), devices, max_epochs=2, val_check_interval=3, limit_val_batches=2, num_sanity_val_steps=0,
            enable_checkpointing=True, callbacks=[every_pass, DrawingLogger()],
        )  # fmt: skip
        trainer.fit(Noisy(str(out)), ckpt_path=ckpt)
        return [json.loads((out / f"rank{r}.json").read_text())["weights"] for r in range(devices)]

    straight = fit(tmp_path / "straight")
    saved = sorted((tmp_path / "straight").glob("step=*.ckpt"), key=lambda p: int(p.stem.split("=")[1]))
    assert [p.name for p in saved][:1] == ["step=3.ckpt"]  # written by the first validation pass, mid-epoch
    for ckpt in saved[:2]:
        assert fit(tmp_path / f"from-{ckpt.stem}", ckpt) == straight, ckpt.name


class ShuffledValidation(Noisy):
    """Validation on a shuffled loader; records the first batch of every pass."""

    def validation_step(self, batch, batch_idx):
        if batch_idx == 0:
            self.drawn.append(float(batch[0].sum()))

    def val_dataloader(self):
        return DataLoader(_data(24, 1), batch_size=4, shuffle=True)


def _first_samples(tmp_path, name, strategy):
    out = tmp_path / name
    out.mkdir()
    trainer = quiet_trainer(
        strategy, 2, max_epochs=1, val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=0
    )
    trainer.fit(ShuffledValidation(str(out)))
    return [json.loads((out / f"rank{r}.json").read_text())["drawn"] for r in range(2)]


@pytest.mark.distributed
def test_a_shuffled_validation_loader_reads_a_new_order_in_every_pass_on_two_ranks(tmp_path):
    # Lightning #17843, stock: the DistributedSampler's order depends on the epoch only, so every validation pass of
    # an epoch reads the same samples (one process with a RandomSampler reads new ones each time).
    stock = _first_samples(tmp_path, "stock", _stock(2))
    assert all(len(passes) == 2 and len(set(passes)) == 1 for passes in stock)
    ours = _first_samples(tmp_path, "ours", _ours(2))
    assert all(len(passes) == 2 and len(set(passes)) == 2 for passes in ours)
    assert ours == _first_samples(tmp_path, "again", _ours(2))  # reproducible


class Augmented(torch.utils.data.Dataset):
    """Augmentation drawn from ``torch.distributions`` in the worker (Lightning #20412's report)."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.distributions.Normal(0.0, 1.0).sample((1,))


class EpochDraws(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(1, 1)
        self.epochs: list[list[float]] = []

    def on_train_epoch_start(self):
        self.epochs.append([])

    def training_step(self, batch, batch_idx):
        self.epochs[-1] += batch.flatten().tolist()
        return self.layer(batch).sum() * 0.0

    def train_dataloader(self):
        return DataLoader(Augmented(), batch_size=4, num_workers=2)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_worker_augmentations_from_torch_distributions_differ_between_epochs():
    from lightning_determinism import WorkerSeedCallback

    # Lightning #20412: under seed_everything(workers=True) the workers drew the same augmentations every epoch (seen
    # here on 2.5.0, 2.5.6 and 2.6.0); Lightning 2.6.1 mixes the worker seed through a hash and the draws differ.
    # The test asserts what the installed release does, so it fails if either changes.
    L.seed_everything(0, workers=True, verbose=False)
    stock = EpochDraws()
    quiet_trainer(SingleDeviceStrategy(device="cpu"), 1, max_epochs=2).fit(stock)
    fixed_upstream = tuple(int(part) for part in L.__version__.split(".")[:3] if part.isdigit()) >= (2, 6, 1)
    assert (stock.epochs[0] != stock.epochs[1]) == fixed_upstream
    ours = EpochDraws()
    trainer = quiet_trainer(_ours(1), 1, max_epochs=2, callbacks=[WorkerSeedCallback()])
    trainer.fit(ours)
    assert ours.epochs[0] != ours.epochs[1] and len(set(ours.epochs[0] + ours.epochs[1])) == 16


class MCDropout(L.LightningModule):
    """Monte-Carlo dropout: dropout stays on in predict, so each sample is another mask."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.layer = nn.Linear(4, 4)
        with torch.no_grad():  # fixed weights, whatever the process's generators hold
            self.layer.weight.copy_(torch.randn(4, 4, generator=gen))
            self.layer.bias.copy_(torch.randn(4, generator=gen))

    def predict_step(self, batch, batch_idx):
        return nn.functional.dropout(self.layer(batch[0]), 0.5, training=True)


def _mc_samples(calls):
    from lightning_determinism.seeding import isolation

    isolation._CALLS.clear()  # a new process: nothing predicted yet
    trainer = quiet_trainer(DeterministicSingleDeviceStrategy(device="cpu", seed=5), 1)
    loader = DataLoader(TensorDataset(torch.ones(3, 4)), batch_size=3)
    model = MCDropout()
    return [torch.cat(trainer.predict(model, loader)) for _ in range(calls)]


def test_repeated_predict_calls_draw_new_masks_and_the_same_sequence_in_every_run():
    first_run, second_run = _mc_samples(3), _mc_samples(3)
    for k in range(3):
        assert torch.equal(first_run[k], second_run[k])  # call k: the same numbers in every run
    masks = [tuple((sample == 0).flatten().tolist()) for sample in first_run]
    assert len(set(masks)) == 3  # each call its own mask (before: call 1 and 2 repeated call 0 exactly)
