"""Checkpoint files cut short or damaged: telling them from foreign files, and the one sentence every reader says.

A zip archive (what ``torch.save`` writes) keeps its central directory at its end, so a save cut short lacks it:
:func:`check_checkpoint_file` finds that by reading the directory alone (milliseconds for any size), before a launch;
:func:`load_failure_message` tells a file ``torch.load`` failed on because it is damaged from one it refused for
another reason (``weights_only``, a foreign format). The plugin's load
(:class:`~lightning_determinism.checkpoints.io.AtomicCheckpointIO`), the check before the launch and
``lightning-determinism report FILE`` all say :func:`damaged_message`'s sentence.

This module is a leaf: it knows the standard library, nothing of torch or Lightning.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

# How torch.save's files begin: a zip archive (since torch 1.6), or the legacy format's pickled magic number.
_ZIP_START = b"PK\x03\x04"
_LEGACY_START = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19"


class DamagedCheckpointError(RuntimeError):
    """A checkpoint file is cut short or damaged: the message names the file, its size and what is wrong.

    Examples:
        >>> issubclass(DamagedCheckpointError, RuntimeError)
        True
    """


def size_text(n: int) -> str:
    """A file size for a message.

    Examples:
        >>> size_text(5510)
        '5510 bytes'
        >>> size_text(1_234_567_890)
        '1.23 GB (1234567890 bytes)'
    """
    for unit, scale in (("GB", 10**9), ("MB", 10**6)):
        if n >= scale:
            return f"{n / scale:.2f} {unit} ({n} bytes)"
    return f"{n} bytes"


def damaged_message(path: str | Path, why: str) -> str:
    """``PATH: a damaged or truncated checkpoint (SIZE; WHY)``, the one sentence every reader of the file says.

    Args:
        path: the damaged file (it must exist: its size goes into the sentence).
        why: what the reader found, e.g. ``"torch.load: ... failed finding central directory"``.

    Examples:
        >>> import pathlib, tempfile
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "step=4.ckpt"
        >>> _ = path.write_bytes(b"PK" + bytes(2_600_000))
        >>> damaged_message(path, "cut short").replace(str(path), "step=4.ckpt")
        'step=4.ckpt: a damaged or truncated checkpoint (2.60 MB (2600002 bytes); cut short)'
    """
    size = os.stat(path).st_size
    if size == 0:
        return f"{path}: an empty file (0 bytes): a save cut short before it wrote anything, or not a checkpoint"
    return f"{path}: a damaged or truncated checkpoint ({size_text(size)}; {why})"


def _file_start(path: str | Path) -> bytes:
    with open(path, "rb") as file:
        return file.read(len(_LEGACY_START))


def is_torch_file(path: str | Path) -> bool:
    """Whether the file begins as ``torch.save`` files do: a zip archive, or the legacy format's magic number.

    Examples:
        >>> import pathlib, tempfile, torch
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "a.ckpt"
        >>> torch.save({}, path)
        >>> is_torch_file(path), is_torch_file(__file__)
        (True, False)
    """
    start = _file_start(path)
    return start.startswith(_ZIP_START) or start == _LEGACY_START


def _damaged(path: str | Path, start: bytes, refused: bool) -> bool:
    """Whether a file that begins like a torch file (``start``) is one cut short or corrupted, not a foreign one."""
    if start.startswith(_ZIP_START):
        try:  # opening reads the central directory, which a zip archive keeps at its end: a cut-off write lacks it
            with zipfile.ZipFile(path):
                return False
        except (zipfile.BadZipFile, OSError, ValueError):
            return True
    return start == _LEGACY_START and not refused


def load_failure_message(path: str | Path, err: BaseException) -> str | None:
    """What to say when ``torch.load(path)`` raised ``err`` because the file is damaged; ``None`` when it is not.

    A file torch refused for another reason (``weights_only``, a foreign format) is no damage: the caller keeps its
    own message for it.

    Args:
        path: the file ``torch.load`` was given.
        err: what it raised.

    Examples:
        >>> import pathlib, tempfile, torch
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "step=4.ckpt"
        >>> torch.save({"w": torch.zeros(1000)}, path)
        >>> _ = path.write_bytes(path.read_bytes()[:2000])  # what a save killed half-way leaves
        >>> try:
        ...     torch.load(path)
        ... except RuntimeError as err:
        ...     print(load_failure_message(path, err).replace(str(path), "step=4.ckpt"))
        step=4.ckpt: a damaged or truncated checkpoint (2000 bytes; torch.load: PytorchStreamReader failed reading zip archive: failed finding central directory)
    """  # noqa: E501
    lines = [line.strip() for line in str(err).splitlines()]
    refused = any(line.startswith("WeightsUnpickler error") for line in lines)
    if os.stat(path).st_size and not _damaged(path, _file_start(path), refused):
        return None
    # The first sentence: torch goes on with advice ("This is an internal miniz error. ...").
    first = lines[0].split(". ")[0] if lines and lines[0] else type(err).__name__  # EOFError has no message
    return damaged_message(path, f"torch.load: {first}")


def check_checkpoint_file(path: str | Path) -> None:
    """The cheap check of a local checkpoint file: it exists, can be read, and a zip archive's directory is whole.

    Reads the first bytes and the zip's central directory (kept at the end of the file, so a save cut short lacks
    it), not the data: milliseconds for any size. A directory (a sharded checkpoint) and a file in torch's legacy
    format pass unchecked; the digest is checked when the file is loaded.

    Args:
        path: a local file.

    Raises:
        FileNotFoundError: if there is no such file.
        PermissionError: if the file cannot be read.
        DamagedCheckpointError: if the file is empty or its zip directory is missing or damaged.

    Examples:
        >>> check_checkpoint_file("missing.ckpt")
        Traceback (most recent call last):
        ...
        FileNotFoundError: missing.ckpt: no such checkpoint file
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such checkpoint file")
    if os.path.isdir(path):
        return
    try:
        start = _file_start(path)
    except OSError as err:
        raise type(err)(f"{path}: the checkpoint cannot be read ({err.strerror or err})") from None
    if not start:
        raise DamagedCheckpointError(damaged_message(path, "empty"))
    if start.startswith(_ZIP_START):
        try:
            with zipfile.ZipFile(path):
                pass
        except (zipfile.BadZipFile, ValueError) as err:
            why = f"the zip archive's central directory, written last, is missing or damaged: {err}"
            raise DamagedCheckpointError(damaged_message(path, why)) from None


def verify_checksums(path: str | Path) -> None:
    """Check every record of a torch zip checkpoint against the CRC-32 torch stored for it (torch.load does not).

    A CRC-32 detects every single-bit error and every burst shorter than 32 bits; it reads the whole file (about
    3 GB/s here: 75 ms for a 240 MB checkpoint) and costs nothing at save time. A file in another format passes.

    Args:
        path: a local checkpoint file.

    Raises:
        DamagedCheckpointError: naming the file and the first record whose bytes do not match their checksum.

    Examples:
        >>> import torch, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "w.ckpt")
        >>> torch.save({"w": torch.zeros(4)}, path)
        >>> verify_checksums(path)  # intact: nothing said
    """
    if os.path.isdir(path) or not _file_start(path).startswith(_ZIP_START):
        return
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, ValueError, EOFError, OSError):
        return  # cut short or unreadable: torch.load says so, in the words the other checks use
    if bad is not None:
        why = f"the bytes of `{bad}` do not match the CRC-32 stored with them (flipped or overwritten bytes)"
        raise DamagedCheckpointError(damaged_message(path, why))


__all__ = [
    "DamagedCheckpointError",
    "check_checkpoint_file",
    "damaged_message",
    "is_torch_file",
    "load_failure_message",
    "size_text",
    "verify_checksums",
]
