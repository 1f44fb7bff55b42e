"""Seed streams for a 2 x 2 (data-parallel x tensor-parallel) layout on 4 CPU processes (gloo).

Each rank prints its coordinates and short digests of three streams:

- ``default``: what dropout on replicated activations draws; the same on tensor-parallel peers, different
  across data-parallel replicas;
- ``model-parallel-rng`` (inside ``tracker.fork()``): what a tensor-parallel shard's dropout or initialisation
  draws; different across tensor-parallel ranks, the same across data-parallel replicas;
- ``generator("noise")``: an isolated per-rank generator.

    python examples/model_parallel_seeding.py [--dp 2 --mp 2 --seed 1234]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_determinism import set_seed
from lightning_determinism.parallel.topology import Topology, model_parallel_seed
from lightning_determinism.seeding.rng import generator, get_rng_tracker


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()[:10]


def worker(rank: int, world_size: int, dp: int, mp_degree: int, seed: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    set_seed(seed)  # the base seed (and seed + rank, replaced just below)
    topo = Topology(rank, world_size, dp_degree=dp, mp_degree=mp_degree)
    seeds = model_parallel_seed(seed, topo)
    default = torch.rand(8)
    with get_rng_tracker().fork():
        tensor_parallel = torch.rand(8)
    noise = torch.rand(8, generator=generator("noise"))
    line = (
        f"rank {rank}: dp {topo.dp_info.rank} mp {topo.mp_info.rank} | default {digest(default)}"
        f" (seed {seeds['default']}) | model-parallel-rng {digest(tensor_parallel)}"
        f" (seed {seeds['model-parallel-rng']}) | generator('noise') {digest(noise)}"
    )
    lines = [None] * world_size
    dist.all_gather_object(lines, line)
    if rank == 0:
        print("\n".join(lines), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--mp", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--start-method", default="spawn", choices=["spawn", "fork", "forkserver"])
    args = parser.parse_args()
    world_size = args.dp * args.mp
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        mp.start_processes(
            worker,
            args=(world_size, args.dp, args.mp, args.seed, store),
            nprocs=world_size,
            start_method=args.start_method,
        )


if __name__ == "__main__":
    main()
