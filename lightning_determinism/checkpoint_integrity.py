"""Checkpoint integrity: a digest of what a checkpoint holds, and what to say about a damaged or cut-short file.

A checkpoint written by :class:`~lightning_determinism.checkpoint_io.AtomicCheckpointIO` (with ``digest=True``) holds,
under :data:`DIGEST_KEY`, a SHA-256 digest of a canonical walk of the rest of the dict: keys and containers in order,
every tensor's dtype, shape and the bytes of its elements, python scalars, strings and bytes exactly (floats by their
64 bits). One flipped bit in a weight changes it; the chance that random damage leaves it unchanged is ``2**-256``.
Loading checks it (:func:`verify_digest`) and removes the key before Lightning sees the dict. The digest of each
top-level entry is kept too, so that a mismatch names the damaged entry (``'state_dict'``, ``'optimizer_states'``).

What the walk covers only by type: objects that are not containers, scalars, strings, tensors or numpy arrays
(a ``weights_only=False`` checkpoint's ``argparse.Namespace``), and tensors that are not strided (sparse, quantized):
by dtype and shape. Tensors of a megabyte or more are hashed in threads (``hashlib`` releases the GIL).

Every message about a damaged file comes from here: the plugin's load, the check before the launch
(:func:`check_checkpoint_file`) and ``lightning-determinism report FILE`` say the same thing.

This module is a leaf: it knows torch, numpy and the standard library, nothing of Lightning.
"""

from __future__ import annotations

import hashlib
import os
import struct
import warnings
import zipfile
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_determinism.errors import DeterminismWarning

DIGEST_KEY = "lightning_determinism_digest"
"""The checkpoint key of the digest: ``{"algorithm": "sha256", "format": 1, "value": hex, "parts": {key: hex}}``."""
ALGORITHM = "sha256"
"""The hash: 1.8 GB/s per core here (SHA-NI), against 0.95 for BLAKE2b; see docs/preemption.md for the figures."""
FORMAT = 1
"""The version of the canonical walk; a checkpoint with another one is loaded unchecked, with a warning."""

_THREADED_BYTES = 1 << 20
"""Tensors this large are hashed in a thread pool."""
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
    """``PATH: a damaged or truncated checkpoint (SIZE; WHY)``, the one sentence every reader of the file says."""
    size = os.stat(path).st_size
    if size == 0:
        return f"{path}: an empty file (0 bytes): a save cut short before it wrote anything, or not a checkpoint"
    return f"{path}: a damaged or truncated checkpoint ({size_text(size)}; {why})"


def _file_start(path: str | Path) -> bytes:
    with open(path, "rb") as file:
        return file.read(len(_LEGACY_START))


def is_torch_file(path: str | Path) -> bool:
    """Whether the file begins as ``torch.save`` files do: a zip archive, or the legacy format's magic number."""
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


def _tagged(tag: bytes, payload: bytes) -> bytes:
    return tag + struct.pack("<Q", len(payload)) + payload


def _tensor_bytes(tensor: torch.Tensor) -> Any:
    """The bytes of a strided tensor's elements, as a flat uint8 array (a view where no copy is needed)."""
    flat = tensor.detach().resolve_conj().resolve_neg().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


def _encode(obj: Any, out: list[Any], active: set[int]) -> None:
    """Append the canonical encoding of ``obj`` to ``out``: bytes, and arrays that count by their own hash."""
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes, bytearray)):
        out.append(_scalar(obj))
    elif isinstance(obj, torch.Tensor):
        header = f"{obj.dtype}{tuple(obj.shape)}".encode()
        data = None
        if obj.layout is torch.strided and not obj.is_quantized and obj.device.type != "meta":
            try:
                data = _tensor_bytes(obj)
            except (RuntimeError, TypeError, NotImplementedError):  # a tensor subclass without plain storage
                data = None
        out.append(_tagged(b"T" if data is not None else b"t", header))
        if data is not None:
            out.append(data)
    elif isinstance(obj, np.ndarray):
        out.append(_tagged(b"A", f"{obj.dtype.str}{obj.shape}".encode()))
        if not obj.dtype.hasobject:
            out.append(np.ascontiguousarray(obj).reshape(-1).view(np.uint8))
    elif isinstance(obj, np.generic):
        out.append(_tagged(b"g", obj.dtype.str.encode() + obj.tobytes()))
    elif isinstance(obj, (Mapping, list, tuple, set, frozenset)):
        if id(obj) in active:
            out.append(b"R")  # a reference cycle: torch.save keeps it, the walk stops there
            return
        active.add(id(obj))
        if isinstance(obj, Mapping):
            out.append(_tagged(b"D", str(len(obj)).encode()))
            for key, value in obj.items():
                _encode(key, out, active)
                _encode(value, out, active)
        elif isinstance(obj, (set, frozenset)):  # no order that survives a new process (string hashing): sorted hashes
            out.append(_tagged(b"S", b"".join(sorted(_hash_pieces(_pieces(item, active)) for item in obj))))
        else:
            out.append(_tagged(b"L", str(len(obj)).encode()))
            for item in obj:
                _encode(item, out, active)
        active.discard(id(obj))
    else:  # by type only: an arbitrary object's repr or state need not survive a save and a load
        out.append(_tagged(b"O", f"{type(obj).__module__}.{type(obj).__qualname__}".encode()))


def _scalar(obj: Any) -> bytes:
    if obj is None:
        return b"N"
    if isinstance(obj, bool):
        return b"?1" if obj else b"?0"
    if isinstance(obj, int):
        return _tagged(b"i", str(obj).encode())
    if isinstance(obj, float):
        return b"f" + struct.pack("<d", obj)
    if isinstance(obj, complex):
        return b"c" + struct.pack("<dd", obj.real, obj.imag)
    if isinstance(obj, str):
        return _tagged(b"s", obj.encode("utf-8", "surrogatepass"))
    return _tagged(b"b", bytes(obj))


def _pieces(obj: Any, active: set[int] | None = None) -> list[Any]:
    out: list[Any] = []
    _encode(obj, out, set() if active is None else active)
    return out


def _hash_pieces(pieces: list[Any], leaves: dict[int, bytes] | None = None) -> bytes:
    """SHA-256 over the pieces, an array counting by its own SHA-256 (from ``leaves`` where computed already)."""
    hasher = hashlib.sha256()
    for piece in pieces:
        if isinstance(piece, bytes):
            hasher.update(piece)
        else:
            hasher.update(leaves[id(piece)] if leaves and id(piece) in leaves else hashlib.sha256(piece).digest())
    return hasher.digest()


def _workers() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus))


def checkpoint_digest(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """The digest of a checkpoint dict (its :data:`DIGEST_KEY` entry left out), as it is stored under that key.

    Examples:
        >>> import torch
        >>> _ = torch.manual_seed(0)
        >>> checkpoint = {"epoch": 1, "state_dict": {"w": torch.randn(3)}}
        >>> digest = checkpoint_digest(checkpoint)
        >>> digest["algorithm"], sorted(digest["parts"])
        ('sha256', ['epoch', 'state_dict'])
        >>> checkpoint["state_dict"]["w"][0] += 1e-7  # one ulp or so: another digest
        >>> checkpoint_digest(checkpoint)["value"] == digest["value"]
        False
    """
    parts = {key: _pieces(key) + _pieces(value) for key, value in checkpoint.items() if key != DIGEST_KEY}
    arrays = [piece for pieces in parts.values() for piece in pieces if not isinstance(piece, bytes)]
    large = [array for array in arrays if array.nbytes >= _THREADED_BYTES]
    leaves: dict[int, bytes] = {}
    if len(large) > 1:
        with ThreadPoolExecutor(min(_workers(), len(large))) as pool:
            hashes = pool.map(lambda array: hashlib.sha256(array).digest(), large)
            leaves = {id(array): h for array, h in zip(large, hashes, strict=True)}
    hashed = {key: _hash_pieces(pieces, leaves) for key, pieces in parts.items()}
    names = {key if isinstance(key, str) else repr(key): value.hex() for key, value in hashed.items()}
    value = hashlib.sha256(b"lightning_determinism digest 1" + b"".join(hashed.values())).hexdigest()
    return {"algorithm": ALGORITHM, "format": FORMAT, "value": value, "parts": names}


def with_digest(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A shallow copy of ``checkpoint`` with its digest under :data:`DIGEST_KEY` (the tensors are not copied)."""
    return {**checkpoint, DIGEST_KEY: checkpoint_digest(checkpoint)}


def describe_digest(checkpoint: Mapping[str, Any]) -> str:
    """What :func:`verify_digest` will make of the checkpoint's digest, for a report.

    Examples:
        >>> describe_digest({"epoch": 0})
        'none recorded (saved without AtomicCheckpointIO(digest=True)): not checked'
    """
    recorded = checkpoint.get(DIGEST_KEY)
    if recorded is None:
        return "none recorded (saved without AtomicCheckpointIO(digest=True)): not checked"
    if _known(recorded):
        return f"{ALGORITHM}, checked against the contents"
    return "of a kind this version cannot check: not checked"


def _known(recorded: Any) -> bool:
    return isinstance(recorded, dict) and (recorded.get("algorithm"), recorded.get("format")) == (ALGORITHM, FORMAT)


def verify_digest(path: str | Path, checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Check a loaded checkpoint against its digest and remove the digest from it; one without passes unchecked.

    Returns:
        ``checkpoint``, without its :data:`DIGEST_KEY` entry.

    Raises:
        DamagedCheckpointError: if the contents do not match the digest, naming the file and the damaged entries.

    Examples:
        >>> import torch
        >>> saved = with_digest({"epoch": 1, "state_dict": {"w": torch.zeros(3)}})
        >>> saved["state_dict"]["w"][1] = 2.0**-149  # one flipped bit
        >>> verify_digest("step=4.ckpt", saved)
        Traceback (most recent call last):
        ...
        lightning_determinism.checkpoint_integrity.DamagedCheckpointError: step=4.ckpt: a damaged checkpoint: its contents do not match its digest in 'state_dict' (flipped or overwritten bytes)
    """  # noqa: E501
    recorded = checkpoint.pop(DIGEST_KEY, None)
    if recorded is None:
        return checkpoint
    if not _known(recorded):
        shown = {k: recorded.get(k) for k in ("algorithm", "format")} if isinstance(recorded, dict) else recorded
        warnings.warn(
            f"{path}: the checkpoint's digest is of a kind this version cannot check ({shown!r}; it checks"
            f" {ALGORITHM!r} format {FORMAT}): loaded unchecked",
            DeterminismWarning,
            stacklevel=2,
        )
        return checkpoint
    computed = checkpoint_digest(checkpoint)
    if computed["value"] != recorded.get("value"):
        saved_parts = recorded.get("parts") if isinstance(recorded.get("parts"), dict) else {}
        names = sorted(set(computed["parts"]) | set(saved_parts))
        damaged = [name for name in names if computed["parts"].get(name) != saved_parts.get(name)] or names
        where = ", ".join(repr(name) for name in damaged)
        raise DamagedCheckpointError(
            f"{path}: a damaged checkpoint: its contents do not match its digest in {where} (flipped or overwritten"
            " bytes)"
        )
    return checkpoint


__all__ = [
    "ALGORITHM",
    "DIGEST_KEY",
    "FORMAT",
    "DamagedCheckpointError",
    "check_checkpoint_file",
    "checkpoint_digest",
    "damaged_message",
    "describe_digest",
    "is_torch_file",
    "load_failure_message",
    "size_text",
    "verify_digest",
    "with_digest",
]
