"""Sharding-invariant digests: throughput against hashlib's sha256, and the memory of fingerprinting a sharded model.

1. Throughput on one CPU thread and on every core: ``tensor_digest.digests([t])`` (two 64-bit lanes, computed in
   torch) against ``hashlib.sha256`` over the same bytes (what ``fingerprint`` used to do after copying the tensor
   to the host), a float32 tensor of 64 Mi elements (256 MiB); the best of 3.
2. Memory: an FSDP2-sharded model of 8 ``Linear(2048, 2048)`` layers (128 MiB of float32 parameters) on 2 CPU
   processes (gloo, forked); each rank's peak-RSS growth while fingerprinting it, by shard (``fingerprint``) and by
   gathering every parameter to its full tensor first (``full_tensor()``, the old way). Each variant in fresh
   processes (the peak RSS only grows).

    python benchmarks/tensor_digest.py
"""

import hashlib
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_determinism.divergence.fingerprint import fingerprint  # noqa: E402
from lightning_determinism.divergence.tensor_digest import digests  # noqa: E402

MIB = 1 << 20


def _best(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def throughput() -> None:
    tensor = torch.randn(64 * MIB)
    size = tensor.numel() * tensor.element_size() / MIB
    print(f"throughput on a {size:.0f} MiB float32 tensor, MiB/s (best of 3)")
    print(f"{'threads':>8} | {'sha256 (hashlib)':>16} | {'tensor digest':>14} | ratio")
    for threads in sorted({1, torch.get_num_threads()}):
        torch.set_num_threads(threads)
        sha = _best(lambda: hashlib.sha256(tensor.numpy().data).hexdigest())
        ours = _best(lambda: digests([tensor]))
        print(f"{threads:>8} | {size / sha:16.0f} | {size / ours:14.0f} | {sha / ours:.2f}x")


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rank(rank: int, world_size: int, store: str, variant: str, results: dict) -> None:
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    mesh = init_device_mesh("cpu", (world_size,))
    model = nn.Sequential(*(nn.Linear(2048, 2048) for _ in range(8)))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    before = _peak_mib()
    if variant == "by shard":
        fingerprint(model)
    else:
        full = {name: p.full_tensor() for name, p in model.named_parameters()}
        digest = hashlib.sha256()
        for tensor in full.values():
            digest.update(tensor.detach().numpy().data)
    results[(variant, rank)] = _peak_mib() - before
    dist.destroy_process_group()


def memory() -> None:
    print("\npeak RSS growth while fingerprinting an FSDP2 model of 128 MiB on 2 ranks, MiB per rank")
    for variant in ("by shard", "gathered"):
        with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
            results = manager.dict()
            store = os.path.join(tmp, "store")
            mp.start_processes(_rank, args=(2, store, variant, results), nprocs=2, start_method="fork")
            print(f"{variant:>9}: {results[(variant, 0)]:7.1f} (rank 0) {results[(variant, 1)]:7.1f} (rank 1)")


if __name__ == "__main__":
    memory()  # first: forked ranks before this process's thread pool exists
    throughput()
