"""Cost of replaying the package's streams in activation checkpointing: a checkpointed training step with the replay
against the same step with torch's checkpointing alone (which recomputes other masks: the wrong gradients).

Target: ratio <= 1.02. A small GPT's blocks (attention + MLP, dropout in the tracker's fork and a named generator's
noise), each under `checkpoint_wrapper` (non-reentrant) or `torch.utils.checkpoint(use_reentrant=True)`; forward,
backward and an SGD step, one thread, interleaved repeats, medians.

    python benchmarks/activation_checkpointing.py [--width 256] [--steps 20] [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

from lightning_determinism._compat import checkpointing
from lightning_determinism.seeding import recompute
from lightning_determinism.seeding.generators import generator
from lightning_determinism.seeding.rng import get_rng_tracker


class Block(nn.Module):
    def __init__(self, width: int, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.o = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, n, w = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(b, n, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        probs = (q @ k.transpose(-2, -1) / (w // self.heads) ** 0.5).softmax(-1)
        with get_rng_tracker().fork():
            probs = nn.functional.dropout(probs, 0.1)
        h = h + self.o((probs @ v).transpose(1, 2).reshape(b, n, w))
        u = nn.functional.gelu(self.up(self.norm2(h)))
        with get_rng_tracker().fork():
            u = nn.functional.dropout(u, 0.1)
        u = u + 0.01 * torch.randn(u.shape, generator=generator("noise"))
        return h + nn.functional.dropout(self.down(u), 0.1)


def model(width: int, impl: CheckpointImpl) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(checkpoint_wrapper(Block(width), checkpoint_impl=impl) for _ in range(4)))


def steps(net: nn.Module, x: torch.Tensor, count: int) -> float:
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    start = time.perf_counter()
    for _ in range(count):
        net(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return (time.perf_counter() - start) / count


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("LDET_BASE_SEED", "0")
    get_rng_tracker().add("model-parallel-rng", 1234)
    x = torch.randn(8, 64, args.width, requires_grad=True)
    print(f"{'checkpointing':<28} {'stock ms':>9} {'replay ms':>10} {'ratio':>7}   (target <= 1.02)")
    for name, impl in (("checkpoint_wrapper", CheckpointImpl.NO_REENTRANT), ("reentrant", CheckpointImpl.REENTRANT)):
        net = model(args.width, impl)
        steps(net, x, 3)  # warm up
        stock, replay = [], []
        for _ in range(args.repeats):  # interleaved: a busy machine slows both alike
            checkpointing.uninstall()
            stock.append(steps(net, x, args.steps))
            checkpointing.install(recompute.snapshot)
            replay.append(steps(net, x, args.steps))
        s, r = statistics.median(stock), statistics.median(replay)
        print(f"{name:<28} {s * 1e3:>9.2f} {r * 1e3:>10.2f} {r / s:>7.3f}")
    snap = min(timeit_snapshot() for _ in range(5))
    print(f"one snapshot (taken per checkpointed block and forward): {snap * 1e6:.1f} us")


def timeit_snapshot(number: int = 10_000) -> float:
    start = time.perf_counter()
    for _ in range(number):
        recompute.snapshot()
    return (time.perf_counter() - start) / number


if __name__ == "__main__":
    main()
