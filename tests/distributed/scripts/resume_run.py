"""One phase of the bitwise-resume acceptance test, in its own process.

python resume_run.py straight OUT            # 4 epochs
python resume_run.py first OUT               # 2 epochs, checkpoint
python resume_run.py resume OUT CKPT         # resume from CKPT to 4 epochs
python resume_run.py first-steps OUT         # stop after 9 steps with a mid-epoch checkpoint at step 5
"""

import os
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from lightning_determinism import DeterministicDDPStrategy, WorkerSeedCallback  # noqa: E402


class Noisy(Dataset):
    """Fixed features; every __getitem__ adds random noise (an augmentation drawn in the workers)."""

    def __init__(self, n: int = 40) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=gen)
        self.y = torch.randn(n, 1, generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i] + 0.1 * torch.randn(8), self.y[i]


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = None

    def configure_model(self) -> None:
        # Built here, the weights come from the strategy's base seed on every rank and in every process.
        if self.net is None:
            self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def train_dataloader(self):
        persist = bool(os.environ.get("PERSIST"))
        return DataLoader(Noisy(), batch_size=4, shuffle=True, num_workers=2, persistent_workers=persist)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def val_dataloader(self):
        return DataLoader(Noisy(8), batch_size=4) if os.environ.get("VAL") else []

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def trainer(out: Path, max_epochs: int, **ckpt) -> L.Trainer:
    return L.Trainer(
        strategy=DeterministicDDPStrategy(seed=17, start_method="fork"),
        accelerator="cpu",
        devices=2,
        max_epochs=max_epochs,
        callbacks=[
            WorkerSeedCallback(per_sample=bool(os.environ.get("PERSAMPLE"))),
            ModelCheckpoint(dirpath=out, save_last=True, **ckpt),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out),
    )


if __name__ == "__main__":
    mode, out = sys.argv[1], Path(sys.argv[2])
    if mode == "straight":
        trainer(out, 4).fit(Net())
    elif mode == "first":
        trainer(out, 2).fit(Net())
    elif mode == "resume":
        trainer(out, 4).fit(Net(), ckpt_path=sys.argv[3])
    elif mode == "first-steps":
        t = trainer(out, 4, every_n_train_steps=5, save_top_k=-1, filename="{step}")
        t.fit_loop.epoch_loop.max_steps = 9
        t.fit(Net())
    else:
        raise SystemExit(f"unknown mode {mode}")
