"""What AtomicCheckpointIO costs against Lightning's TorchCheckpointIO, with and without its digest.

A Lightning-shaped checkpoint of an MLP (float32 weights and Adam's two moments after one step; ~240 MB at the
default 20M parameters) is saved and loaded by each plugin, interleaved, and the medians printed side by side. Loads
are timed twice: with the file in the page cache (warm) and after dropping this file's pages
(``posix_fadvise(DONTNEED)``: cold, read from the disk). First the throughput of the candidate hashes over the same
tensor bytes, on one thread.

    python benchmarks/checkpoint_io.py [--parameters 20_000_000] [--repeats 5] [--dir DIR]

``--dir`` is where the checkpoints are written (default: a new temporary directory); put it on the filesystem you
care about (NFS, Lustre) to see the cost there.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from torch import nn

from lightning_determinism.checkpoints.integrity import checkpoint_digest
from lightning_determinism.checkpoints.io import AtomicCheckpointIO


def build_checkpoint(parameters: int) -> dict[str, Any]:
    """A Lightning-shaped checkpoint of a 4-layer MLP with about ``parameters`` weights, after one Adam step."""
    torch.manual_seed(0)
    width = int((parameters / 4) ** 0.5)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(8, width)).sum().backward()
    optimizer.step()
    return {
        "epoch": 3,
        "global_step": 1200,
        "pytorch-lightning_version": "2.6.6",
        "state_dict": model.state_dict(),
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 3, "completed": 3}}}},
        "callbacks": {},
        "optimizer_states": [optimizer.state_dict()],
        "lr_schedulers": [],
    }


def tensor_bytes(checkpoint: dict[str, Any]) -> list[Any]:
    state = checkpoint["optimizer_states"][0]["state"].values()
    tensors = [*checkpoint["state_dict"].values(), *(t for entry in state for t in entry.values())]
    return [t.reshape(-1).view(torch.uint8).numpy() for t in tensors]


def hash_throughput(arrays: list[Any]) -> None:
    total = sum(a.nbytes for a in arrays)
    candidates: dict[str, Callable[[], object]] = {
        "sha256": lambda: [hashlib.sha256(a).digest() for a in arrays],
        "blake2b (256 bits)": lambda: [hashlib.blake2b(a, digest_size=32).digest() for a in arrays],
        "sha1": lambda: [hashlib.sha1(a).digest() for a in arrays],
        "crc32 (zlib)": lambda: [zlib.crc32(a) for a in arrays],
    }
    print(f"hash throughput over {total / 1e6:.0f} MB of tensor bytes, one thread (best of 3):")
    for name, run in candidates.items():
        best = min(timed_once(run) for _ in range(3))
        print(f"   {name:20s}{total / best / 1e9:8.2f} GB/s")


def timed_once(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def drop_cache(path: Path) -> None:
    with open(path, "rb") as file:
        os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parameters", type=int, default=20_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    directory = args.dir or Path(tempfile.mkdtemp(prefix="ldet-checkpoint-io-"))
    directory.mkdir(parents=True, exist_ok=True)
    checkpoint = build_checkpoint(args.parameters)
    hash_throughput(tensor_bytes(checkpoint))
    digest_time = min(timed_once(lambda: checkpoint_digest(checkpoint)) for _ in range(3))
    print(f"   checkpoint_digest of the whole checkpoint ({min(8, os.cpu_count() or 1)} threads at most): "
          f"{digest_time * 1e3:.0f} ms")  # fmt: skip

    plugins = {
        "Lightning TorchCheckpointIO": TorchCheckpointIO(),
        "AtomicCheckpointIO(verify_checksums=False)": AtomicCheckpointIO(verify_checksums=False),
        "AtomicCheckpointIO": AtomicCheckpointIO(),  # the default: the stored CRC-32s checked at load
        "AtomicCheckpointIO(digest=True)": AtomicCheckpointIO(digest=True),
    }
    paths = {name: directory / f"{i}.ckpt" for i, name in enumerate(plugins)}
    times: dict[str, dict[str, list[float]]] = {name: {"save": [], "warm": [], "cold": []} for name in plugins}
    for _ in range(args.repeats):  # interleaved, so that a slow moment of the machine hits them all alike
        for name, plugin in plugins.items():
            path = paths[name]
            times[name]["save"].append(timed_once(lambda: plugin.save_checkpoint(checkpoint, path)))  # noqa: B023
            times[name]["warm"].append(timed_once(lambda: plugin.load_checkpoint(path)))  # noqa: B023
            drop_cache(path)
            times[name]["cold"].append(timed_once(lambda: plugin.load_checkpoint(path)))  # noqa: B023
    size = paths["AtomicCheckpointIO"].stat().st_size
    print(f"\ncheckpoint: {size / 1e6:.0f} MB on disk, in {directory} (median of {args.repeats}, ms)")
    reference = {kind: statistics.median(values) for kind, values in times["AtomicCheckpointIO"].items()}
    bare = {k: statistics.median(v) for k, v in times["AtomicCheckpointIO(verify_checksums=False)"].items()}
    print(f"   {'':34s}{'save':>10s}{'load warm':>12s}{'load cold':>12s}")
    for name in plugins:
        medians = {kind: statistics.median(values) for kind, values in times[name].items()}
        row = "".join(f"{medians[kind] * 1e3:>{w}.0f}" for kind, w in (("save", 10), ("warm", 12), ("cold", 12)))
        print(f"   {name:34s}{row}")
    digest = {kind: statistics.median(values) for kind, values in times["AtomicCheckpointIO(digest=True)"].items()}
    extra = "".join(
        f"{(digest[kind] / reference[kind] - 1) * 100:>{w - 1}.0f}%"
        for kind, w in (("save", 10), ("warm", 12), ("cold", 12))
    )
    print(f"   {'the digest adds':34s}{extra}")
    crc = "".join(
        f"{(reference[kind] / bare[kind] - 1) * 100:>{w - 1}.0f}%"
        for kind, w in (("save", 10), ("warm", 12), ("cold", 12))
    )
    print(f"   {'checking the CRC-32s adds':34s}{crc}")
    if args.dir is None:
        shutil.rmtree(directory)


if __name__ == "__main__":
    main()
