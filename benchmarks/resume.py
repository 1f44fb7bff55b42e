"""Time to the first batch after resuming at 0 % and at 90 % of an epoch, beside skipping by reading batches.

A resumable loader (what the deterministic strategies make of every training DataLoader) drops the consumed batches'
indices before any sample is read, so resuming late in an epoch should cost what resuming at its start does (target:
90 % <= 1.1x 0 %). The reference is what accelerate's ``skip_first_batches`` and the HF Trainer do: iterate the
loader and throw the batches away, reading (and augmenting) every skipped sample.

One epoch of 1,000,000 samples (each costs ~5 us of work to produce), batches of 64, 2 workers (fork), shuffled. With
workers and per-worker seeds (``WorkerSeedCallback(per_sample=False)``) the resumed workers replay their earlier
fetches: that row is O(position), beside reading the skipped batches.

    python benchmarks/resume.py [--samples 1000000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from types import SimpleNamespace

import torch
from torch.utils.data import DataLoader, Dataset

from lightning_determinism.data.positions import set_plan
from lightning_determinism.data.resumable import make_resumable
from lightning_determinism.data.worker_seeding import LoaderSeeding

torch.set_num_threads(1)


class Samples(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        x = torch.full((16,), float(i))
        return x.sin_().mul_(torch.rand(16))  # a little work and a random draw, like an augmentation


def _loader(samples: int, workers: int, per_sample: bool = True) -> DataLoader:
    loader = DataLoader(
        Samples(samples), batch_size=64, shuffle=True, num_workers=workers, generator=torch.Generator().manual_seed(0)
    )
    if workers:  # per-sample seeds: O(1); per-worker seeds: the workers replay their earlier fetches
        LoaderSeeding(base_seed=0, rank=0, per_sample=per_sample).prepare(loader, "train")
    return loader


class _Trainer:
    """The two things of a Trainer a resumable loader reads: the loop's epoch and its list of loaders."""

    def __init__(self, loader: DataLoader) -> None:
        progress = SimpleNamespace(current=SimpleNamespace(processed=0))
        combined = SimpleNamespace(flattened=[loader])
        self.fit_loop = SimpleNamespace(epoch_progress=progress, _combined_loader=combined)


def time_to_first_batch(samples: int, workers: int, fraction: float, repeats: int, per_sample: bool = True) -> float:
    loader = _loader(samples, workers, per_sample)
    trainer = _Trainer(loader)
    make_resumable(loader, trainer)
    next(iter(loader))  # an epoch begins: the loader keeps its epoch-start RNG states
    start_states = loader._ldet_epoch_start  # type: ignore[attr-defined]
    skip = int(fraction * len(loader))
    times = []
    for _ in range(repeats):
        set_plan(trainer, [{"epoch": 0, "skip": skip, "epoch_start": start_states}])
        start = time.perf_counter()
        next(iter(loader))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_by_reading(samples: int, workers: int, fraction: float) -> float:
    loader = _loader(samples, workers)
    skip = int(fraction * len(loader))
    start = time.perf_counter()
    iterator = iter(loader)
    for _ in range(skip):  # what skip_first_batches does: every skipped sample is read
        next(iterator)
    next(iterator)
    return time.perf_counter() - start


def main() -> None:
    warnings.simplefilter("ignore")
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"time to the first batch after resuming, {args.samples:,} samples per epoch, batches of 64, shuffled")
    print(f"   {'':44s}{'at 0 %':>12s}{'at 90 %':>12s}{'90 % / 0 %':>14s}")
    for workers, per_sample, label in (
        (0, True, "resumable loader, 0 workers (target <= 1.1x)"),
        (2, True, "2 workers, per-sample seeds (target <= 1.1x)"),
        (2, False, "2 workers, per-worker seeds (replayed)"),
    ):
        repeats = args.repeats if per_sample else 1
        at_0 = time_to_first_batch(args.samples, workers, 0.0, repeats, per_sample)
        at_90 = time_to_first_batch(args.samples, workers, 0.9, repeats, per_sample)
        print(f"   {label:44s}{at_0 * 1e3:>10.1f}ms{at_90 * 1e3:>10.1f}ms{at_90 / at_0:>13.2f}x")
    reading = time_by_reading(args.samples, 2, 0.9)
    label = "reading the skipped batches, 2 workers"
    print(f"   {label:44s}{'':>12s}{reading * 1e3:>10.0f}ms{reading / at_0:>13.0f}x")


if __name__ == "__main__":
    main()
