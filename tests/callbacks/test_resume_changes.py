"""Nothing silent at resume, in one process: a stock Lightning checkpoint, other data, batch size, workers or
accumulation each resume exactly, are refused, or get one warning that says what will be repeated or skipped."""

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_determinism import DeterminismWarning, DeterministicSingleDeviceStrategy
from lightning_determinism.callbacks.rng_checkpoint import CHECKPOINT_KEY
from tests.helpers.lightning_models import quiet_trainer


class Ids(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return i, torch.full((4,), float(i))


class IdsModule(L.LightningModule):
    """Records, per optimizer step, the sample ids it trained on (to `out/ids.json` at the end of training)."""

    def __init__(self, out: Path, n: int = 24, batch_size: int = 4, shuffle: bool = False, workers: int = 0) -> None:
        super().__init__()
        self.out, self.n, self.batch_size, self.shuffle, self.workers = out, n, batch_size, shuffle, workers
        self.net = nn.Linear(4, 1)
        self.ids: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        ids, x = batch
        self.ids.append(ids.tolist())
        return self.net(x).square().mean()

    def train_dataloader(self):
        return DataLoader(Ids(self.n), batch_size=self.batch_size, shuffle=self.shuffle, num_workers=self.workers)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def on_train_end(self) -> None:
        (self.out / "ids.json").write_text(json.dumps(self.ids))


def _fit(out: Path, module_kwargs=None, ckpt=None, every_step=False, **trainer_kwargs):
    out.mkdir(parents=True, exist_ok=True)
    callbacks = [ModelCheckpoint(dirpath=out, every_n_train_steps=1, save_top_k=-1, filename="{step}")]
    trainer = quiet_trainer(
        DeterministicSingleDeviceStrategy(seed=3, device="cpu"), 1, max_epochs=2, callbacks=callbacks,
        enable_checkpointing=True, **trainer_kwargs,
    )  # fmt: skip
    trainer.fit(IdsModule(out, **(module_kwargs or {})), ckpt_path=ckpt)
    return json.loads((out / "ids.json").read_text())


def _stock(path: Path, out: Path) -> Path:
    """The checkpoint as stock Lightning writes it: no RNG state, no data position."""
    checkpoint = torch.load(path, weights_only=True)
    checkpoint.pop(CHECKPOINT_KEY)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, out / "stock.ckpt")
    return out / "stock.ckpt"


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    root = tmp_path_factory.mktemp("changes")
    return root, _fit(root / "straight"), _fit(root / "shuffled", {"shuffle": True})


def test_a_stock_mid_epoch_checkpoint_resumes_at_the_next_sample_where_the_order_depends_on_the_epoch(straight):
    root, ids, _ = straight
    stock = _stock(root / "straight" / "step=3.ckpt", root / "stock")  # 3 of 6 batches into epoch 0
    with pytest.warns(DeterminismWarning, match="holds no RNG state"):
        resumed = _fit(root / "from-stock", ckpt=stock)
    assert resumed == ids[3:]  # Lightning alone restarted the epoch: ids 0-11 twice, 12-23 never


def test_a_stock_mid_epoch_checkpoint_of_a_shuffled_loader_says_what_is_repeated_and_skipped(straight):
    root, _, shuffled = straight
    stock = _stock(root / "shuffled" / "step=3.ckpt", root / "stock-shuffled")
    with pytest.warns(DeterminismWarning, match="some samples are trained twice in this epoch and others not at all"):
        resumed = _fit(root / "from-stock-shuffled", {"shuffle": True}, ckpt=stock)
    assert len(resumed) == len(shuffled) - 3  # what the warning says: the epoch trains only the batches it had left
    assert sorted(i for batch in resumed[:3] for i in batch) != sorted(i for batch in shuffled[3:6] for i in batch)


@pytest.mark.parametrize(
    ("module_kwargs", "match"),
    [({"n": 20}, "length 24 -> 20"), ({"batch_size": 8}, "batch_size 4 -> 8")],
    ids=["dataset-length", "batch-size"],
)
def test_other_data_or_batch_size_mid_epoch_is_refused(straight, tmp_path, module_kwargs, match):
    root, _, _ = straight
    with pytest.raises(RuntimeError, match=rf"3 batches into epoch 0 of a training loader whose {match} since"):
        _fit(tmp_path, module_kwargs, ckpt=root / "straight" / "step=3.ckpt")


def test_other_data_at_an_epoch_boundary_is_accepted(straight, tmp_path):
    root, _, _ = straight
    resumed = _fit(tmp_path, {"batch_size": 8}, ckpt=root / "straight" / "step=6.ckpt")  # the end of epoch 0
    assert [i for batch in resumed for i in batch] == list(range(24))


def test_other_num_workers_without_per_sample_seeds_warns_that_worker_randomness_differs(straight, tmp_path):
    root, ids, _ = straight
    with pytest.warns(DeterminismWarning, match="num_workers 0 -> 2: the interrupted epoch continues at its next"):
        resumed = _fit(tmp_path, {"workers": 2}, ckpt=root / "straight" / "step=3.ckpt")
    assert resumed == ids[3:]  # the same samples; only randomness drawn in the workers would differ


def test_other_accumulation_warns(straight, tmp_path):
    root, _, _ = straight
    with pytest.warns(DeterminismWarning, match="accumulate_grad_batches=1 and is resumed with 2"):
        _fit(tmp_path, ckpt=root / "straight" / "step=6.ckpt", accumulate_grad_batches=2)
