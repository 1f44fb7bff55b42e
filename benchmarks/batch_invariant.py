"""Evaluation throughput with batch-invariant evaluation against stock kernels, side by side (CPU here; CUDA where
there is one).

Per model (the tiny LM's GRU, examples/tiny_lm.py, and one 4x wider; the causal transformer of
examples/batch_invariant_eval.py, 2 blocks of width 64 and 4 heads, and a wider one of 4 blocks of width 256),
precision (float32, bf16 autocast) and eval batch size: the time of one validation step (forward, the exact
perplexity's update) over windows of 64 tokens, stock and under ``batch_invariant()``, interleaved, the median of the
repeats. Then one ``trainer.validate`` pass of the tiny LM over its validation set, with ``batch_invariant=True`` on
the strategy or not: what a user's evaluation costs end to end. One intra-op thread, as the examples use.

Goal (issue 57): at most 1.2x stock on CPU.

    python benchmarks/batch_invariant.py [--repeats 7] [--batches 8] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import lightning as L  # noqa: E402
from batch_invariant_eval import CausalTransformer  # noqa: E402
from tiny_lm import TinyLM, build_data  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_determinism import (  # noqa: E402
    DeterministicSingleDeviceStrategy,
    DistributedPerplexity,
    batch_invariant,
)

GOAL = 1.2


def _models(vocab: int) -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    return {
        "gru (tiny LM)": TinyLM(vocab).eval(),
        "gru 128 / 512": TinyLM(vocab, dim=128, hidden=512).eval(),
        "transformer 2x64": CausalTransformer(vocab).eval(),
        "transformer 4x256": CausalTransformer(vocab, dim=256, heads=8, layers=4).eval(),
    }


def _step_ms(model: torch.nn.Module, batches: list[torch.Tensor], bf16: bool, device: str, on: bool) -> float:
    metric = DistributedPerplexity().to(device)

    def run() -> None:
        with torch.inference_mode(), torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
            for batch in batches:
                logits = model(batch[:, :-1]).float()
                metric.update(logits, batch[:, 1:])
        if device == "cuda":
            torch.cuda.synchronize()

    if on:
        with batch_invariant():
            start = time.perf_counter()
            run()
    else:
        start = time.perf_counter()
        run()
    return (time.perf_counter() - start) / len(batches) * 1e3


def steps(args: argparse.Namespace) -> list[float]:
    _, val_set, vocab = build_data()
    whole = [torch.cat((w["input_ids"], w["labels"][-1:])) for w in (val_set[i] for i in range(len(val_set)))]
    whole = [w for w in whole if len(w) == len(whole[0])]
    windows = torch.stack([whole[i % len(whole)] for i in range(16 * args.batches)])
    ratios = []
    print(f"one validation step, ms (median of {args.repeats}; device {args.device}, {torch.get_num_threads()} thread)")
    print(f"{'model':<20} {'precision':<10} {'batch':>5} {'stock':>9} {'invariant':>10} {'ratio':>7}")
    for name, model in _models(vocab).items():
        model.to(args.device)
        for bf16 in (False, True):
            for size in (1, 4, 16):
                batches = [windows[i * size : (i + 1) * size].to(args.device) for i in range(args.batches)]
                _step_ms(model, batches, bf16, args.device, True)  # warm both paths
                _step_ms(model, batches, bf16, args.device, False)
                stock, mode = [], []
                for _ in range(args.repeats):
                    stock.append(_step_ms(model, batches, bf16, args.device, False))
                    mode.append(_step_ms(model, batches, bf16, args.device, True))
                s, m = statistics.median(stock), statistics.median(mode)
                ratios.append(m / s)
                precision = "bf16" if bf16 else "float32"
                print(f"{name:<20} {precision:<10} {size:>5} {s:>9.2f} {m:>10.2f} {m / s:>6.2f}x")
    return ratios


def validate(args: argparse.Namespace) -> tuple[float, float]:
    _, val_set, vocab = build_data()
    torch.manual_seed(0)
    model = TinyLM(vocab)
    loader = DataLoader(val_set, batch_size=16)
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.repeats):
        for on in (False, True):
            trainer = L.Trainer(
                strategy=DeterministicSingleDeviceStrategy(device=args.device, seed=0, batch_invariant=on),
                accelerator=args.device, devices=1, logger=False, enable_progress_bar=False,
                enable_model_summary=False, enable_checkpointing=False,
            )  # fmt: skip
            start = time.perf_counter()
            trainer.validate(model, loader, verbose=False)
            times[on].append(time.perf_counter() - start)
    return statistics.median(times[False]), statistics.median(times[True])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batches", type=int, default=8, help="validation steps per timing")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    ratios = steps(args)
    stock, mode = validate(args)
    print(f"\ntrainer.validate, tiny LM, {len(build_data()[1])} windows at eval batch 16: stock {stock * 1e3:.0f} ms,"
          f" batch_invariant=True {mode * 1e3:.0f} ms, {mode / stock:.2f}x")  # fmt: skip
    worst = max(ratios)
    print(f"worst validation step: {worst:.2f}x stock; median {statistics.median(ratios):.2f}x (goal: <= {GOAL}x)")


if __name__ == "__main__":
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    main()
