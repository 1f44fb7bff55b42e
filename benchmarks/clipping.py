"""The cost of exact (sharding-invariant) gradient clipping against torch's clip_grad_norm_, in a clipped step.

A small GPT-ish model (token embedding, 4 pre-norm MLP blocks of width 128 -> 512 -> 128, a tied-size head; ~0.6M
parameters), sequences of 64 tokens, 4 micro-batches of 4 sequences per optimizer step (1024 tokens), AdamW, one
intra-op thread per process. Each step: K forward/backward passes, clipping to a max norm below the gradients' (so it
scales on every step), the optimizer step. Reported: the median step time with torch's ``clip_grad_norm_`` and with
:func:`~lightning_determinism.invariance.clipping.clip_grad_norm_exact_` (target <= 1.05x), and the clipping call
alone. The two variants alternate step by step, so drifts of the machine hit both alike.

1. one process (plain parameters);
2. FSDP2 on 2 gloo processes (``fully_shard`` per block and the root: DTensor gradients, the norm all-reduced).

    python benchmarks/clipping.py [--steps 30] [--skip-fsdp]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from datetime import timedelta

import torch

torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

from lightning_determinism.invariance.clipping import clip_grad_norm_exact_  # noqa: E402

VOCAB, WIDTH, SEQ, MICRO, K, MAX_NORM = 512, 128, 64, 4, 4, 0.05


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[torch.Tensor], exact: bool) -> float:
    """One clipped optimizer step; returns the clipping call's seconds."""
    for tokens in batches:
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)) / len(batches)
        loss.backward()
    start = time.perf_counter()
    if exact:
        clip_grad_norm_exact_(model.parameters(), MAX_NORM)
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    clip = time.perf_counter() - start
    optimizer.step()
    optimizer.zero_grad()
    return clip


def _measure(model: nn.Module, steps: int, rank: int = 0) -> dict[str, list[float]]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    times: dict[str, list[float]] = {"stock": [], "exact": [], "stock-clip": [], "exact-clip": []}
    for i in range(2 * steps + 4):
        batches = [torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=gen) for _ in range(K)]
        exact = i % 2 == 1
        start = time.perf_counter()
        clip = _step(model, optimizer, batches, exact)
        if i >= 4:  # warm-up steps left out
            name = "exact" if exact else "stock"
            times[name].append(time.perf_counter() - start)
            times[f"{name}-clip"].append(clip)
    return times


def _report(title: str, times: dict[str, list[float]]) -> None:
    med = {key: statistics.median(values) * 1e3 for key, values in times.items()}
    print(f"{title}: step {med['stock']:.1f} ms (torch) vs {med['exact']:.1f} ms (exact) ="
          f" {med['exact'] / med['stock']:.3f}x; clipping alone {med['stock-clip']:.2f} ms vs"
          f" {med['exact-clip']:.2f} ms")  # fmt: skip


def _fsdp_rank(rank: int, workdir: str, steps: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))  # fmt: skip
    try:
        mesh = init_device_mesh("cpu", (2,))
        torch.manual_seed(0)
        model = TinyGPT()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        times = _measure(model, steps, rank)
        if rank == 0:
            _report("FSDP2, 2 gloo processes", times)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="steps of each variant (default 30)")
    parser.add_argument("--skip-fsdp", action="store_true", help="one process only")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = TinyGPT()
    print(f"TinyGPT: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, {K} x {MICRO} x {SEQ} tokens"
          " per step, max_norm below every step's norm")  # fmt: skip
    _report("one process", _measure(model, args.steps))
    if not args.skip_fsdp:
        with tempfile.TemporaryDirectory() as workdir:
            mp.start_processes(_fsdp_rank, args=(workdir, args.steps), nprocs=2, start_method="fork")


if __name__ == "__main__":
    main()
