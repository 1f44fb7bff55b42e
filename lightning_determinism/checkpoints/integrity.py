"""Checkpoint integrity: a digest of what a checkpoint holds, recorded when it is saved, checked when it is loaded.

A checkpoint written by :class:`~lightning_determinism.checkpoints.io.AtomicCheckpointIO` (with ``digest=True``) holds,
under :data:`DIGEST_KEY`, a SHA-256 digest of a canonical walk of the rest of the dict: keys and containers in order,
every tensor's dtype, shape and the bytes of its elements, python scalars, strings and bytes exactly (floats by their
64 bits). One flipped bit in a weight changes it; the chance that random damage leaves it unchanged is ``2**-256``.
Loading checks it (:func:`verify_digest`) and removes the key before Lightning sees the dict. The digest of each
top-level entry is kept too, so that a mismatch names the damaged entry (``'state_dict'``, ``'optimizer_states'``).

What the walk covers only by type: objects that are not containers, scalars, strings, tensors or numpy arrays
(a ``weights_only=False`` checkpoint's ``argparse.Namespace``), and tensors that are not strided (sparse, quantized):
by dtype and shape. Tensors of a megabyte or more are hashed in threads (``hashlib`` releases the GIL).

A mismatch is one :class:`~lightning_determinism.checkpoints.file.DamagedCheckpointError` naming the file and the
entries; the plugin's load and ``lightning-determinism report FILE`` say the same thing.

This module is a leaf: it knows torch, numpy and the standard library, nothing of Lightning.
"""

from __future__ import annotations

import hashlib
import os
import struct
import warnings
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_determinism.checkpoints.file import DamagedCheckpointError
from lightning_determinism.errors import DeterminismWarning

DIGEST_KEY = "lightning_determinism_digest"
"""The checkpoint key of the digest: ``{"algorithm": "sha256", "format": 1, "value": hex, "parts": {key: hex}}``."""
ALGORITHM = "sha256"
"""The hash: 1.7-1.8 GB/s a core here (SHA extensions), against 0.9 for BLAKE2b; docs/preemption.md has the figures."""
FORMAT = 1
"""The version of the canonical walk; a checkpoint with another one is loaded unchecked, with a warning."""

_THREADED_BYTES = 1 << 20
"""Tensors this large are hashed in a thread pool."""


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

    Args:
        checkpoint: the dict ``torch.save`` is given, or ``torch.load`` returned.

    Returns:
        ``{"algorithm": "sha256", "format": 1, "value": hex, "parts": {top-level key: hex}}``.

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
    """A shallow copy of ``checkpoint`` with its digest under :data:`DIGEST_KEY` (the tensors are not copied).

    Examples:
        >>> saved = with_digest({"epoch": 1})
        >>> sorted(saved), saved[DIGEST_KEY]["algorithm"]
        (['epoch', 'lightning_determinism_digest'], 'sha256')
    """
    return {**checkpoint, DIGEST_KEY: checkpoint_digest(checkpoint)}


def describe_digest(checkpoint: Mapping[str, Any]) -> str:
    """What :func:`verify_digest` will make of the checkpoint's digest, for a report.

    Args:
        checkpoint: a loaded checkpoint dict.

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

    A digest of a kind this version does not know (another algorithm or walk) is removed with a
    :class:`~lightning_determinism.errors.DeterminismWarning`, unchecked.

    Args:
        path: the file the checkpoint came from, for the message.
        checkpoint: the loaded dict; its :data:`DIGEST_KEY` entry is removed in place.

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
        lightning_determinism.checkpoints.file.DamagedCheckpointError: step=4.ckpt: a damaged checkpoint: its contents do not match its digest in 'state_dict' (flipped or overwritten bytes)
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
    "checkpoint_digest",
    "describe_digest",
    "verify_digest",
    "with_digest",
]
