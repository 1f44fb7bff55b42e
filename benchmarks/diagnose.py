"""Cost of the divergence probe: the tiny LM's optimizer step with every module hooked, against no probe.

One CPU process, one intra-op thread, the tiny LM of ``examples/tiny_lm.py`` (batch 16 x 64 characters). Three fits
alternate in each round: no probe, a probe recording every step (every module hooked, every gradient digested), and a
probe present but recording none of the timed steps (its hooks are off). The figure is the median step time (from
``on_train_batch_start`` to ``on_train_batch_end``) over all rounds. Target: recording <= 2x a step; 1.00x when off.

    python benchmarks/diagnose.py [--rounds 3] [--steps 40]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from tiny_lm import TinyLM, build_data  # noqa: E402

from lightning_determinism import DeterministicSingleDeviceStrategy, DivergenceProbe  # noqa: E402


class StepTimer(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter() - self._start)


def timed_steps(probe_steps: list[int] | None, steps: int, out: Path) -> list[float]:
    train_set, _, vocab_size = build_data()
    timer = StepTimer()
    callbacks: list[L.Callback] = [timer]
    if probe_steps is not None:
        callbacks.insert(0, DivergenceProbe(out / "probe.json", steps=probe_steps))  # its hooks run inside the timing
    trainer = L.Trainer(
        strategy=DeterministicSingleDeviceStrategy(seed=42, device="cpu"), accelerator="cpu", devices=1,
        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(TinyLM(vocab_size), DataLoader(train_set, batch_size=16, shuffle=True))
    return timer.times[2:]  # the first steps warm the allocator up


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(tempfile.mkdtemp())
    timed_steps(None, 5, out)  # warm-up: imports, page cache
    kinds = {"no probe": None, "probe recording": list(range(args.steps)), "probe off": [10 * args.steps]}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for i in range(args.rounds):
        order = list(kinds) if i % 2 == 0 else list(reversed(kinds))  # drift in load hits all alike
        for kind in order:
            times[kind] += timed_steps(kinds[kind], args.steps, out)
    base = statistics.median(times["no probe"])
    size = (out / "probe.json").stat().st_size
    print(f"tiny LM, batch 16 x 64, 1 thread; median of {len(times['no probe'])} steps per kind")
    for kind, values in times.items():
        median = statistics.median(values)
        print(f"  {kind:<16} {median * 1e3:8.2f} ms  {median / base:5.2f}x")
    print(f"target: recording <= 2.00x, off 1.00x; probe file {size / 1e3:.0f} kB for {args.steps} steps")


if __name__ == "__main__":
    main()
