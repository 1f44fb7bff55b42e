"""Cost of isolating one evaluation pass (save every RNG state, seed the evaluation streams, restore) against one
validation step of the tiny LM (batch of 32 windows of 64 characters, float32, one thread).

Target: negligible beside a validation step (it is paid once per pass, not per step).

    python benchmarks/isolation.py [--number 2000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import timeit
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from tiny_lm import TinyLM, build_data  # noqa: E402

from lightning_determinism.seeding.isolation import evaluation_streams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--number", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    _, val_set, vocab = build_data()
    model = TinyLM(vocab).eval()
    batch = torch.stack([val_set[i]["input_ids"] for i in range(32)])

    def switch() -> None:
        with evaluation_streams("validate", 0, 10, base_seed=42, rank=0):
            pass

    @torch.no_grad()
    def validation_step() -> None:
        logits = model(batch)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.flatten())

    def median_us(fn, number: int) -> float:
        return statistics.median(t / number * 1e6 for t in timeit.repeat(fn, number=number, repeat=args.repeats))

    steps = max(1, args.number // 100)
    switch_us, step_us = median_us(switch, args.number), median_us(validation_step, steps)
    print(f"{'stream switch per evaluation pass':<40} {switch_us:>10.1f} us")
    print(f"{'one validation step of the tiny LM':<40} {step_us:>10.1f} us")
    print(f"{'switch / step':<40} {switch_us / step_us:>10.3f}")


if __name__ == "__main__":
    main()
