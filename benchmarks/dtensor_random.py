"""DTensor dropout drawn whole (exact: each shard its slice of the one-device mask) against DTensor's own local draw.

Dropout (p=0.1) on an activation DTensor of shape (batch 8, tokens 128, features F) sharded on the features
(Shard(2), as a column-parallel output kept as a DTensor), tensor_parallel_size=2 on 2 CPU processes (gloo, forked),
1 intra-op thread per rank; the median of 30 calls after 5 warm-up ones, on rank 0. Beside it, the same dropout of
the whole tensor on one process (what the exact way draws on every rank).

    python benchmarks/dtensor_random.py
"""

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
FEATURES = (256, 1024, 4096)
CALLS, WARMUP = 30, 5


def _median_ms(fn) -> float:
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(CALLS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _rank(rank: int, world_size: int, store: str, results: dict) -> None:
    sys.path.insert(0, str(ROOT))
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_determinism.parallel import dtensor_random

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    mesh = init_device_mesh("cpu", (world_size,))
    for features in FEATURES:
        x = distribute_tensor(torch.ones(8, 128, features), mesh, [Shard(2)], src_data_rank=None)
        local = _median_ms(lambda x=x: torch.nn.functional.dropout(x, 0.1))
        dtensor_random.install()
        exact = _median_ms(lambda x=x: torch.nn.functional.dropout(x, 0.1))
        dtensor_random.uninstall()
        if rank == 0:
            whole = torch.ones(8, 128, features)
            one = _median_ms(lambda whole=whole: torch.nn.functional.dropout(whole, 0.1))
            results[features] = (one, local, exact)
    dist.destroy_process_group()


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_rank, args=(2, os.path.join(tmp, "store"), results), nprocs=2, start_method="fork")
        print(f"dropout on a (8, 128, F) activation, Shard(2) over tensor_parallel_size=2, median of {CALLS} calls, ms")
        print(f"{'F':>6} | {'one process, whole':>18} | {'DTensor stock (shard own draw)':>30} |"
              f" {'exact (whole draw)':>18} | exact / stock")  # fmt: skip
        for features in FEATURES:
            one, local, exact = results[features]
            print(f"{features:>6} | {one:18.3f} | {local:30.3f} | {exact:18.3f} | {exact / local:.2f}x")


if __name__ == "__main__":
    main()
