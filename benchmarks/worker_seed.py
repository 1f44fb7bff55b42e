"""Cost of WorkerSeedCallback: time to first batch and steady-state batch time, with and without it.

One process, ``num_workers=2``, a dataset that does a little CPU work per item (a random crop and a sum), fits
alternating between a Trainer without the callback (Lightning's default seeding, ``seed_everything(0)``) and
one with ``WorkerSeedCallback()`` (and, for information, ``per_sample=True``). Target: ratio <= 1.02.

    python benchmarks/worker_seed.py [--repeats 9]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_determinism import WorkerSeedCallback


class CropDataset(Dataset):
    def __init__(self, n: int = 1024, length: int = 32768) -> None:
        self.data = torch.randn(n + 1, length, generator=torch.Generator().manual_seed(0))
        self.length = length

    def __len__(self) -> int:
        return len(self.data) - 1

    def __getitem__(self, i: int) -> torch.Tensor:
        offset = random.randrange(self.length // 2)
        row = torch.cat([self.data[i, offset:], self.data[i + 1, :offset]])
        return row[: self.length // 2] * torch.rand(1)


class Timed(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(16384, 1)
        self.stamps: list[float] = []

    def on_fit_start(self) -> None:
        self.stamps = [time.perf_counter()]

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        return self.layer(batch).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def run(callbacks: list) -> tuple[float, float]:
    L.seed_everything(0, verbose=False)
    model = Timed()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = DataLoader(CropDataset(), batch_size=32, shuffle=True, num_workers=2)
    trainer.fit(model, loader)
    first = model.stamps[1] - model.stamps[0]
    steady = statistics.median(b - a for a, b in zip(model.stamps[5:], model.stamps[6:], strict=False))
    return first, steady


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    configs = {
        "no callback (reference)": lambda: [],
        "WorkerSeedCallback()": lambda: [WorkerSeedCallback()],
        "WorkerSeedCallback(per_sample=True)": lambda: [WorkerSeedCallback(per_sample=True)],
    }
    run([])  # warm-up
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in configs}
    for i in range(args.repeats):
        names = list(configs) if i % 2 == 0 else list(reversed(configs))  # alternate the order
        for name in names:
            results[name].append(run(configs[name]()))
    ref_first = statistics.median(r[0] for r in results["no callback (reference)"])
    ref_steady = statistics.median(r[1] for r in results["no callback (reference)"])
    print(f"{'':40s}{'first batch ms':>16s}{'ratio':>8s}{'batch ms':>10s}{'ratio':>8s}")
    for name, runs in results.items():
        first = statistics.median(r[0] for r in runs)
        steady = statistics.median(r[1] for r in runs)
        print(f"{name:40s}{first * 1e3:16.1f}{first / ref_first:8.3f}{steady * 1e3:10.2f}{steady / ref_steady:8.3f}")
    print(f"(medians over {args.repeats} alternating runs, num_workers=2, batch 32; target ratio <= 1.02)")


if __name__ == "__main__":
    main()
