"""Distributed checkpoint directories published whole: written under a hidden name, then renamed into place.

Lightning's distributed save rewrites ``last.ckpt/`` (or ``preempted.ckpt/``) in place: the shards first, rank 0's
``meta.pt`` after them. A job killed in between leaves the new shards beside the old ``meta.pt``, and a resume loads
that directory as if it were one checkpoint (the old step, the new weights). Under the deterministic strategies a
save instead:

1. writes every rank's part into a hidden sibling ``.NAME.TOKEN.tmp/`` (``_`` of the name spelt ``-``: Lightning's
   ``hpc_ckpt_N`` lookup and its ``last*.ckpt`` glob see none of it), the token drawn by rank 0 and broadcast;
2. marks each part with the token: every rank's shard file holds the entry ``lightning_determinism_save_RANK``; each
   rank takes the size and CRC-32 of the shard files it wrote
   (:func:`~lightning_determinism.checkpoints.shard_digests.shard_digests`), and rank 0 writes
   :data:`MARK` last, naming the token, the world size, the step, the size and CRC-32 of ``meta.pt`` and those of
   every shard file;
3. once every rank has written (a barrier), rank 0 publishes it: where the final name exists, the two directories
   are swapped in one ``renameat2(RENAME_EXCHANGE)`` (Linux), else the old one is renamed aside to
   ``.NAME.TOKEN.old`` and the new one into place; then the old one is deleted. Only this save's own hidden
   directories are removed: a hidden save of another token (one a kill cut short, or another run's in progress in a
   shared directory: from here the two look alike) stays, named once in a warning.

At every instant the final name is the complete old checkpoint, the complete new one, or (between the two renames
where the swap is not available) missing with both complete ones hidden beside it:
:func:`finish_interrupted_publish` then puts the new one in place (the next save does, and the check before a resume
from that name). :func:`check_save_parts` refuses a directory whose parts carry different marks, and
:func:`~lightning_determinism.checkpoints.shard_digests.verify_shard_digests` a shard file whose bytes are not the
ones its rank wrote (a flipped bit loads silently otherwise: DCP keeps no checksum).

This module knows ``os`` and, to read a shard's mark, torch's DCP index; nothing of Lightning.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import os
import re
import secrets
import shutil
import warnings
from pathlib import Path
from typing import Any

from lightning_determinism.checkpoints.file import DamagedCheckpointError
from lightning_determinism.checkpoints.shard_digests import INDEX_NAME, MARK, SHARD_SUFFIX, size_and_crc
from lightning_determinism.errors import DeterminismWarning

SHARD_MARK = "lightning_determinism_save_"
"""The prefix of the entry each rank adds to its shards: ``lightning_determinism_save_<rank>`` -> ``token:rank``."""
_META = "meta.pt"  # Lightning's rank 0 part (checkpoints.distributed.META; not imported: it imports this module)
_TOKEN = re.compile(r"[0-9a-f]{16}")
_RENAME_EXCHANGE = 2


def new_token() -> str:
    """A fresh token for one save (rank 0 draws it; the strategy broadcasts it).

    Examples:
        >>> len(new_token()), new_token() != new_token()
        (16, True)
    """
    return secrets.token_hex(8)


def hidden_path(final: str | os.PathLike[str], token: str, kind: str = "tmp") -> Path:
    """Where a save of ``final`` is written (``kind="tmp"``) or the old checkpoint is put aside (``"old"``).

    Examples:
        >>> hidden_path("/ckpt/hpc_ckpt_2.ckpt", "0123456789abcdef").name
        '.hpc-ckpt-2.ckpt.0123456789abcdef.tmp'
    """
    final = Path(final)
    return final.parent / f".{_spelt(final.name)}.{token}.{kind}"


def _spelt(name: str) -> str:
    return name.replace("_", "-")  # no "hpc_ckpt_" in a hidden name: Lightning would parse its digits as a version


def _hidden_siblings(final: Path) -> dict[str, dict[str, Path]]:
    """The hidden directories of ``final`` left beside it, by token: ``{"tmp": ..., "old": ...}``."""
    pattern = re.compile(rf"\.{re.escape(_spelt(final.name))}\.({_TOKEN.pattern})\.(tmp|old)")
    found: dict[str, dict[str, Path]] = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir(final.parent):
            match = pattern.fullmatch(entry.name)
            if match:
                found.setdefault(match.group(1), {})[match.group(2)] = Path(entry.path)
    return found


def shard_entries(token: str, rank: int) -> dict[str, str]:
    """The entry rank ``rank`` adds to the state it saves with DCP: its shard file then carries the save's token.

    Examples:
        >>> shard_entries("0123456789abcdef", 1)
        {'lightning_determinism_save_1': '0123456789abcdef:1'}
    """
    return {f"{SHARD_MARK}{rank}": f"{token}:{rank}"}


def write_mark(
    directory: str | os.PathLike[str],
    token: str,
    world_size: int,
    step: int | None,
    shards: dict[str, tuple[int, int]] | None = None,
) -> None:
    """Rank 0, after its ``meta.pt``: record the save (token, world size, step, sizes and CRC-32s of its files).

    ``meta.pt`` and the mark are synced to disk (DCP syncs the shards), so the rename publishes durable files.

    Args:
        directory: the hidden directory of the save.
        token: the save's token.
        world_size: how many ranks wrote shards.
        step: the global step saved (``None`` where there is none).
        shards: every shard file's ``(size, CRC-32)`` by name (``shard_digests`` of every rank); a shard file of
            the directory not in it, and DCP's index, are read here.
    """
    directory = Path(directory)
    with open(directory / _META, "rb") as meta:
        os.fsync(meta.fileno())  # the bytes the mark vouches for are on disk before it is
    size, crc = size_and_crc(directory / _META)
    digests = dict(shards or {})
    for name in sorted(os.listdir(directory)):
        if (name.endswith(SHARD_SUFFIX) or name == INDEX_NAME) and name not in digests:  # the index, unclaimed files
            digests[name] = size_and_crc(directory / name)
    mark = {
        "token": token, "world_size": world_size, "global_step": step, "meta_size": size, "meta_crc32": crc,
        "shards": {name: list(value) for name, value in sorted(digests.items())},
    }  # fmt: skip
    with open(directory / MARK, "w") as file:
        json.dump(mark, file)
        file.flush()
        os.fsync(file.fileno())


def publish(hidden: str | os.PathLike[str], final: str | os.PathLike[str]) -> None:
    """Rank 0, once every rank has written into ``hidden``: put it under ``final`` (see the module's docstring).

    Raises:
        OSError: what the filesystem said; the final name is then the old checkpoint, or missing with both beside it
            (:func:`finish_interrupted_publish` settles that).
    """
    hidden, final = Path(hidden), Path(final)
    _fsync_directory(hidden)
    if os.path.lexists(final):
        if _exchange(hidden, final):
            old = hidden  # the swap put the old checkpoint under the hidden name
        else:
            old = hidden_path(final, hidden.name.rsplit(".", 2)[-2], "old")
            os.rename(final, old)
            os.rename(hidden, final)
        _fsync_directory(final.parent)
        _remove(old)
    else:
        os.rename(hidden, final)
        _fsync_directory(final.parent)
    _say_what_others_left(final)


_SAID: set[str] = set()  # the directories whose leftovers were named once in this process


def _say_what_others_left(final: Path) -> None:
    """Name, once per directory, the hidden saves of ``final``'s name that this save did not write; remove none.

    One is a save a kill cut short, or another run's save in progress in a shared directory: from here they look the
    same, and deleting the second would lose that run's checkpoint, so only its own leftovers are a save's to remove.
    """
    others = sorted(path.name for parts in _hidden_siblings(final).values() for path in parts.values())
    if others and str(final.parent) not in _SAID:
        _SAID.add(str(final.parent))
        warnings.warn(
            f"{final.parent}: hidden saves of {final.name} that this run did not write are left as they are"
            f" ({', '.join(others)}): a save a kill cut short, or another run's in progress; delete them once no run"
            " writes there",
            DeterminismWarning,
            stacklevel=3,
        )


def finish_interrupted_publish(final: str | os.PathLike[str]) -> str | None:
    """Settle a publish of ``final`` that a kill cut between its two renames; returns what was done, or ``None``.

    Only where ``final`` is missing and a hidden old checkpoint is there (the publish had begun, so the new one beside
    it is complete): the new one is put in place (the old one if the new one is gone). A hidden ``.tmp`` alone is a
    save killed before it was published, or another run's in progress: it stays hidden (the next save names it).

    Examples:
        >>> import tempfile
        >>> final = Path(tempfile.mkdtemp()) / "last.ckpt"
        >>> finish_interrupted_publish(final) is None
        True
    """
    final = Path(final)
    if os.path.lexists(final):
        return None
    for parts in _hidden_siblings(final).values():
        if "old" not in parts:
            continue
        chosen = parts.get("tmp", parts["old"])
        try:
            os.rename(chosen, final)
        except FileNotFoundError:  # another process settled it first
            continue
        _remove(parts["old"])
        which = "the new checkpoint" if chosen is not parts["old"] else "the previous checkpoint"
        return f"{final}: a save was killed while publishing it; {which} is put in place ({chosen.name})"
    return None


def finish_interrupted_publishes(directory: str | os.PathLike[str]) -> list[str]:
    """:func:`finish_interrupted_publish` for every hidden old checkpoint in ``directory`` (before a resume).

    Examples:
        >>> import tempfile
        >>> finish_interrupted_publishes(tempfile.mkdtemp())
        []
    """
    pattern = re.compile(rf"\.(.+)\.({_TOKEN.pattern})\.old")
    done: list[str] = []
    with contextlib.suppress(OSError):
        names = {entry.name: Path(entry.path) for entry in os.scandir(directory)}
        for name in sorted(names):
            match = pattern.fullmatch(name)
            if match:  # the hidden name spells "_" as "-": the final name is the one whose spelling matches
                candidates = [n for n in names if not n.startswith(".") and _spelt(n) == match.group(1)]
                final = Path(directory) / (candidates[0] if candidates else match.group(1))
                message = finish_interrupted_publish(final)
                if message is not None:
                    done.append(message)
    return done


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); ``False`` where the system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):  # not Linux, or a C library without it
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_cwd = -100
    return renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), _RENAME_EXCHANGE) == 0  # EINVAL on NFS: False


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def _fsync_directory(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def check_save_parts(path: str | os.PathLike[str], index: Any) -> dict[str, Any] | None:
    """Refuse a distributed checkpoint directory whose parts come from different saves (see the module's docstring).

    A directory without :data:`MARK` and without marked shards (Lightning's own save, an earlier release) passes:
    nothing says what belongs together.

    Returns:
        The save's mark (for ``shard_digests.verify_shard_digests``), ``None`` for a directory without one.

    Args:
        path: the directory.
        index: its DCP index (``FileSystemReader(path).read_metadata()``).

    Raises:
        DamagedCheckpointError: one line naming the directory and the part that does not belong.
    """
    path = Path(path)
    marked = sorted(key for key in index.state_dict_metadata if key.startswith(SHARD_MARK))
    mixed = f"{path}: a distributed checkpoint mixed from two saves:"
    if not (path / MARK).is_file():
        if marked:
            raise DamagedCheckpointError(f"{mixed} its shards are marked with a save but {MARK} is missing")
        return None
    try:
        mark = json.loads((path / MARK).read_text())
        token, world_size, step = str(mark["token"]), int(mark["world_size"]), mark["global_step"]
        written = (int(mark["meta_size"]), int(mark["meta_crc32"]))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DamagedCheckpointError(
            f"{path}: a damaged distributed checkpoint: {MARK} cannot be read ({err})"
        ) from err
    this = f"save {token} (step {step})"
    if size_and_crc(path / _META) != written:
        raise DamagedCheckpointError(f"{mixed} {_META}{_meta_step(path)} is not the one {this} wrote")
    expected = [f"{SHARD_MARK}{rank}" for rank in range(world_size)]
    if sorted(marked) != sorted(expected):
        raise DamagedCheckpointError(
            f"{mixed} {this} was written by {world_size} ranks, its index {INDEX_NAME} lists the shards of"
            f" {len(marked)}"
        )
    for key in expected:
        where, found = _read_mark(path, index, key)
        if found.split(":")[0] != token:
            other = f"save {found.split(':')[0]}" if _TOKEN.fullmatch(found.split(":")[0]) else "another save"
            raise DamagedCheckpointError(f"{mixed} the shard file {where} is from {other}, the rest from {this}")
    written_at = getattr(getattr(index, "storage_meta", None), "checkpoint_id", None)
    if written_at is not None and token not in os.fspath(written_at):
        raise DamagedCheckpointError(f"{mixed} its index {INDEX_NAME} is not the one {this} wrote")
    return dict(mark)


def _read_mark(path: Path, index: Any, key: str) -> tuple[str, str]:
    """The shard file holding ``key`` and the mark it holds (``"?"`` where the bytes there are not a mark)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    info = (getattr(index, "storage_data", None) or {}).get(MetadataIndex(key))
    where = str(getattr(info, "relative_path", "?"))
    if info is None:
        return where, "?"
    try:
        with open(path / where, "rb") as file:
            file.seek(int(info.offset))
            data = file.read(int(info.length))
        import torch

        value = torch.load(io.BytesIO(data), weights_only=True)
    except Exception:  # noqa: BLE001  (any bytes may be there: another save's shard file of another layout)
        return where, "?"
    return where, value if isinstance(value, str) else "?"


def _meta_step(path: Path) -> str:
    """`` (step K)`` as the ``meta.pt`` there says, for the message; empty where it cannot be read."""
    try:
        import torch

        meta = torch.load(path / _META, map_location="cpu", weights_only=True)
        return f" (step {int(meta['global_step'])})"
    except Exception:  # noqa: BLE001  (only for the message)
        return ""


__all__ = [
    "MARK",
    "SHARD_MARK",
    "check_save_parts",
    "finish_interrupted_publish",
    "finish_interrupted_publishes",
    "hidden_path",
    "new_token",
    "publish",
    "shard_entries",
    "write_mark",
]
