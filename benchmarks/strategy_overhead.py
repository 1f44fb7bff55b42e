"""Cost of the deterministic strategy: the tiny LM's fit under DeterministicDDPStrategy vs Lightning's DDPStrategy.

Both run 2 CPU processes (fork start, gloo) with the same backend flags (deterministic algorithms on, as
``debug_mode="error"`` sets them), alternating in one process; the figure is the median of per-pair ratios.
Target: <= 1.02.

    python benchmarks/strategy_overhead.py [--pairs 9] [--epochs 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from tiny_lm import TinyLM, build_data  # noqa: E402

from lightning_determinism import DeterministicDDPStrategy, configure_determinism  # noqa: E402


def timed_fit(strategy, epochs: int) -> float:
    train_set, val_set, vocab_size = build_data()
    L.seed_everything(42, verbose=False)
    configure_determinism("error")  # the baseline gets the same flags the deterministic strategy sets
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    model = TinyLM(vocab_size)
    start = time.perf_counter()
    trainer.fit(model, DataLoader(train_set, batch_size=16, shuffle=True), DataLoader(val_set, batch_size=16))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=9)
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    timed_fit(DDPStrategy(start_method="fork"), 1)  # warm-up: imports, allocator, page cache
    plain, ours, ratios = [], [], []
    for i in range(args.pairs):
        # Alternate which one goes first so drift in machine load hits both alike.
        if i % 2 == 0:
            a = timed_fit(DDPStrategy(start_method="fork"), args.epochs)
            b = timed_fit(DeterministicDDPStrategy(seed=42, start_method="fork"), args.epochs)
        else:
            b = timed_fit(DeterministicDDPStrategy(seed=42, start_method="fork"), args.epochs)
            a = timed_fit(DDPStrategy(start_method="fork"), args.epochs)
        plain.append(a)
        ours.append(b)
        ratios.append(b / a)
    print(f"{'':28s}{'median s':>10s}{'min s':>10s}")
    print(f"{'DDPStrategy (reference)':28s}{statistics.median(plain):10.3f}{min(plain):10.3f}")
    print(f"{'DeterministicDDPStrategy':28s}{statistics.median(ours):10.3f}{min(ours):10.3f}")
    print(
        f"median ratio (deterministic / reference) over {args.pairs} pairs: {statistics.median(ratios):.4f}"
        "  (target <= 1.02)"
    )


if __name__ == "__main__":
    main()
