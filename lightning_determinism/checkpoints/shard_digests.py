"""The sizes and CRC-32s of a distributed checkpoint's files: taken by each rank at the save, checked before a load.

DCP stores no checksum of its shard files: a flipped bit in one loads silently. Under the deterministic strategies each
rank, once its DCP save returned, takes the size and CRC-32 of the shard files it wrote (:func:`shard_digests`);
rank 0 records them, with DCP's index's, in the save's :data:`MARK`
(:mod:`~lightning_determinism.checkpoints.publish`). Before a load the index is checked before it is unpickled
(:func:`verify_index_digest`) and every shard file against its record (:func:`verify_shard_digests`), the ranks
sharing the reading. ``benchmarks/shard_digests.py`` measures what it costs.

This module knows ``os``, ``zlib`` and, to tell another save's index, torch's DCP reader; nothing of Lightning.
"""

from __future__ import annotations

import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lightning_determinism.checkpoints.file import DamagedCheckpointError

MARK = "lightning_determinism_save.json"
"""Rank 0's record of the save a distributed checkpoint directory holds, written after every other part."""
SHARD_SUFFIX = ".distcp"
"""DCP's shard files: ``__RANK_N.distcp``."""
INDEX_NAME = ".metadata"
"""DCP's index of the shards."""
_CHUNK = 1 << 22  # 4 MiB reads: zlib.crc32 at memory speed, a small buffer


def size_and_crc(path: str | os.PathLike[str]) -> tuple[int, int]:
    """A file's size and CRC-32, read in 4 MiB pieces (``zlib.crc32`` releases the GIL: files hash in threads).

    Examples:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "__0_0.distcp"
        >>> _ = path.write_bytes(b"shard")
        >>> size_and_crc(path)
        (5, 2550246860)
    """
    crc, size = 0, 0
    with open(path, "rb", buffering=0) as file:
        buffer = bytearray(_CHUNK)
        view = memoryview(buffer)
        while read := file.readinto(buffer):
            crc, size = zlib.crc32(view[:read], crc), size + read
    return size, crc


def shard_digests(directory: str | os.PathLike[str], rank: int) -> dict[str, tuple[int, int]]:
    """Each rank, once its DCP save returned: the ``(size, CRC-32)`` of the shard files it wrote (``__RANK_*.distcp``).

    Examples:
        >>> import tempfile
        >>> directory = Path(tempfile.mkdtemp())
        >>> _ = (directory / "__1_0.distcp").write_bytes(b"shard")
        >>> shard_digests(directory, 1), shard_digests(directory, 0)
        ({'__1_0.distcp': (5, 2550246860)}, {})
    """
    directory = Path(directory)
    prefix = f"__{rank}_"
    return {
        name: size_and_crc(directory / name)
        for name in sorted(os.listdir(directory))
        if name.startswith(prefix) and name.endswith(SHARD_SUFFIX)
    }


def _recorded_shards(mark: dict[str, Any]) -> dict[str, tuple[int, int]]:
    shards = mark.get("shards") or {}
    return {str(name): (int(value[0]), int(value[1])) for name, value in shards.items()}


def verify_index_digest(path: str | os.PathLike[str]) -> None:
    """Before DCP's index is unpickled: it is the one its save wrote (size and CRC-32 in :data:`MARK`, where recorded).

    Raises:
        DamagedCheckpointError: one line naming the directory and its index.
    """
    try:
        mark = json.loads((Path(path) / MARK).read_text())
    except (OSError, ValueError):
        return  # no mark (stock Lightning's save), or a damaged one: publish.check_save_parts says so
    if not isinstance(mark, dict) or INDEX_NAME not in (mark.get("shards") or {}):
        return
    try:
        verify_shard_digests(path, {"shards": {INDEX_NAME: mark["shards"][INDEX_NAME]}})
    except DamagedCheckpointError:
        if _another_saves_index(Path(path), str(mark.get("token"))):
            return  # whole, but another save's: publish.check_save_parts names the save
        raise


def _another_saves_index(path: Path, token: str) -> bool:
    """Whether the index unpickles whole and was written by another save than ``token``'s."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        written_at = FileSystemReader(path).read_metadata().storage_meta.checkpoint_id  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001  (damaged: any error may come of the pickle)
        return False
    return written_at is not None and token not in os.fspath(written_at)


def verify_shard_digests(path: str | os.PathLike[str], mark: dict[str, Any], share: tuple[int, int] = (0, 1)) -> None:
    """Check the shard files against the sizes and CRC-32s their ranks recorded in the save's mark.

    A mark without digests (an earlier release) passes. Files are read in threads (zlib releases the GIL).

    Args:
        path: the distributed checkpoint directory.
        mark: its :data:`MARK`, read (``publish.check_save_parts`` returns it).
        share: ``(rank, world_size)``: this process checks every ``world_size``-th file from the ``rank``-th (the
            ranks share the reading at load); ``(0, 1)``: all of them.

    Raises:
        DamagedCheckpointError: one line naming the directory and the first shard file that does not match.
    """
    path = Path(path)
    recorded = sorted(_recorded_shards(mark).items())
    rank, world_size = share
    mine = recorded[rank::world_size]
    if not mine:
        return

    def damaged(name: str) -> str:
        what = f"its index {name}" if name == INDEX_NAME else f"the shard file {name}"
        return f"{path}: a damaged distributed checkpoint: {what}"

    for name, (size, _) in mine:
        try:
            found = (path / name).stat().st_size
        except OSError:
            raise DamagedCheckpointError(f"{damaged(name)} that {MARK} names is missing") from None
        if found != size:
            raise DamagedCheckpointError(f"{damaged(name)} is {found} bytes, its rank wrote {size}")
    with ThreadPoolExecutor(max(1, min(len(mine), os.cpu_count() or 1, 8))) as pool:
        computed = list(pool.map(lambda item: size_and_crc(path / item[0]), mine))
    for (name, (_, crc)), (_, found_crc) in zip(mine, computed, strict=True):
        if found_crc != crc:
            raise DamagedCheckpointError(
                f"{damaged(name)} does not match the CRC-32 its rank recorded when it wrote it ({found_crc:08x},"
                f" written {crc:08x}: flipped or overwritten bytes)"
            )


__all__ = [
    "INDEX_NAME",
    "MARK",
    "SHARD_SUFFIX",
    "shard_digests",
    "size_and_crc",
    "verify_index_digest",
    "verify_shard_digests",
]
