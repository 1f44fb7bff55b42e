"""What the shard files' CRC-32s cost a distributed checkpoint: seconds per GB, against the DCP save itself.

A state dict of float32 tensors (``--megabytes``, 512 MB by default) is saved with torch.distributed.checkpoint on one
process (the shard file a rank writes), then its shard file's size and CRC-32 taken as a rank takes them after its
save (``lightning_determinism.checkpoints.shard_digests.shard_digests``): warm (the file still in the page cache, as
right after the save) and cold (its pages dropped with ``posix_fadvise(DONTNEED)``, as a check before a resume reads
it). Medians of ``--repeats``.

    python benchmarks/shard_digests.py [--megabytes 512] [--repeats 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from lightning_determinism.checkpoints.shard_digests import shard_digests


def _drop_pages(directory: Path) -> None:
    for name in os.listdir(directory):
        fd = os.open(directory / name, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(dir=args.dir))
    torch.manual_seed(0)
    count = args.megabytes * (1 << 20) // 4 // 8
    state = {"state_dict": {f"layer{i}.weight": torch.randn(count) for i in range(8)}}
    saves, warm, cold = [], [], []
    try:
        for repeat in range(args.repeats):
            target = root / f"step={repeat}.ckpt"
            start = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "torch.distributed is disabled": one process, on purpose
                dcp.save(state, checkpoint_id=target, no_dist=True)
            saves.append(time.perf_counter() - start)
            start = time.perf_counter()
            digests = shard_digests(target, 0)
            warm.append(time.perf_counter() - start)
            _drop_pages(target)
            start = time.perf_counter()
            shard_digests(target, 0)
            cold.append(time.perf_counter() - start)
            shutil.rmtree(target)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gigabytes = sum(size for size, _ in digests.values()) / 1e9
    save, crc_warm, crc_cold = (statistics.median(times) for times in (saves, warm, cold))
    print(f"shard file: {gigabytes:.2f} GB, medians of {args.repeats}")
    print(f"DCP save (one process):   {save:.3f} s = {save / gigabytes:.3f} s/GB")
    print(
        f"CRC-32, warm (after save): {crc_warm:.3f} s = {crc_warm / gigabytes:.3f} s/GB"
        f" ({crc_warm / save:.0%} of the save)"
    )
    print(f"CRC-32, cold (before load): {crc_cold:.3f} s = {crc_cold / gigabytes:.3f} s/GB")


if __name__ == "__main__":
    main()
