"""Record a 1-process numerical baseline, then check a 2-rank DDP run against it before trusting its speed.

Both runs see the same global batch of 8 in each optimizer step: both use the DDP strategy, whose
``DistributedSampler`` draws one permutation from the seed on any world size (rank r of W takes every W-th index),
and the single process accumulates 2 batches of 4 where each of the 2 ranks takes one. They start from the same
weights (built in ``configure_model`` under the deterministic strategies) and have no dropout, so they must agree up
to the order of float sums in the gradient all-reduce.

    python examples/compare_single_vs_ddp.py [--out DIR] [--plot]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.set_num_threads(1)

import lightning as L  # noqa: E402

from lightning_determinism import DeterministicDDPStrategy  # noqa: E402
from lightning_determinism.callbacks.baseline import NumericalBaseline  # noqa: E402
from lightning_determinism.divergence.cli import main as cli  # noqa: E402


class Regressor(L.LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.lr = lr
        self.net: nn.Module | None = None

    def configure_model(self) -> None:
        if self.net is None:
            self.net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(64, 16, generator=gen)
        y = x[:, :1] * 2 - x[:, 1:2] + 0.1 * torch.randn(64, 1, generator=gen)
        return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def run(devices: int, callback: NumericalBaseline, lr: float = 0.05) -> None:
    trainer = L.Trainer(
        strategy=DeterministicDDPStrategy(seed=7, start_method="fork"),
        accelerator="cpu",
        devices=devices,
        accumulate_grad_batches=2 // devices,  # 8 samples per optimizer step on 1 process and on 2
        max_steps=callback.steps,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regressor(lr))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="where to keep the baseline files (default: a temporary folder)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--plot", action="store_true", help="also write compare.png (needs matplotlib)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        single, ddp = out / "single.json", out / "ddp.json"
        run(1, NumericalBaseline(single, steps=args.steps))
        # The check itself: compare mode raises at the first step beyond tolerance.
        run(2, NumericalBaseline(single, steps=args.steps, mode="compare"))
        print("2-rank DDP run matches the 1-process baseline within the default tolerances")
        # A record of the DDP run, for the side-by-side table (and the plot).
        run(2, NumericalBaseline(ddp, steps=args.steps))
        argv = ["compare", str(single), str(ddp)]
        if args.plot:
            argv += ["--plot", str(Path(args.out or ".") / "compare.png")]
        return cli(argv)


if __name__ == "__main__":
    raise SystemExit(main())
