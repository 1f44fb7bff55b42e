"""A job that died after an epoch's validation pass, resumed from the checkpoint of the epoch's last batch (before the
pass) in the same directory: the replayed pass's ModelCheckpoint(monitor=..., save_top_k=2) writes over the file the
interrupted run wrote for it, as the uninterrupted run wrote it once, instead of a `-v1` copy that best_k_models
would then point to."""

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_determinism import DeterministicSingleDeviceStrategy

pytestmark = pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")


class _Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).square().mean()

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.net(batch[0]).square().mean())

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(8, 2, generator=torch.Generator().manual_seed(0))), batch_size=2)

    val_dataloader = train_dataloader

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(root: Path, max_steps: int = -1, ckpt_path: str | None = None) -> ModelCheckpoint:
    torch.manual_seed(0)  # the module's initial weights, built before the strategy seeds
    topk = ModelCheckpoint(dirpath=root / "topk", filename="{epoch}-{step}", monitor="val_loss", save_top_k=2)
    steps = ModelCheckpoint(dirpath=root / "steps", filename="{step}", every_n_train_steps=1, save_top_k=-1)
    trainer = L.Trainer(strategy=DeterministicSingleDeviceStrategy(seed=1, device="cpu"), max_epochs=2,
                        max_steps=max_steps, logger=False, callbacks=[steps, topk], enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)  # fmt: skip
    trainer.fit(_Net(), ckpt_path=ckpt_path)
    return topk


def test_the_replayed_validation_writes_over_the_interrupted_runs_top_k_file(tmp_path):
    straight = _fit(tmp_path / "straight")
    _fit(tmp_path / "job", max_steps=6)  # epoch 0 (4 steps) and its validation, then 2 steps: the job dies there
    resumed = _fit(tmp_path / "job", ckpt_path=str(tmp_path / "job" / "steps" / "step=4.ckpt"))  # before the pass
    names = sorted(Path(path).name for path in straight.best_k_models)
    assert names == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"]
    assert sorted(Path(path).name for path in resumed.best_k_models) == names  # not epoch=0-step=4-v1.ckpt
    assert not list((tmp_path / "job" / "topk").glob("*-v1.ckpt"))
    for name in names:
        want = torch.load(tmp_path / "straight" / "topk" / name, weights_only=True)["state_dict"]
        got = torch.load(tmp_path / "job" / "topk" / name, weights_only=True)["state_dict"]
        assert all(torch.equal(want[key], got[key]) for key in want)
