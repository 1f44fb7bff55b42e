"""Digests: exact, cheap hashes of tensors, batches and random states, and the small numbers beside them.

A digest is a sha256 hash, cut to 16 bytes (32 hex digits), of a value's structure, and of each tensor's dtype, shape
and position-keyed digest (:mod:`~lightning_determinism.divergence.tensor_digest`), computed on the tensor's device:
16 bytes per tensor reach the host, not the tensor; a ``DTensor`` adds its shard's part at the elements' global
positions (no communication), so the shards' parts of one activation add up to the whole tensor's digest. Equal for
the same bits, different when one bit differs, never a comparison within a tolerance. The probe keeps digests, not
tensors, so its file stays small; beside them it keeps a float64 norm, to say how far apart two runs are once their
digests differ.

This module is a leaf: it knows torch and numpy, not Lightning.
"""

from __future__ import annotations

import hashlib
import random
from array import array
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from lightning_determinism.divergence.tensor_digest import digests, full_norms, hex_digest, is_dtensor, shard_lanes

_MASK = (1 << 64) - 1


def _update(h: Any, obj: Any, whole: Mapping[int, str]) -> None:
    if isinstance(obj, torch.Tensor):
        lanes = whole.get(id(obj)) or hex_digest(shard_lanes(obj))
        h.update(f"T|{obj.dtype}|{tuple(obj.shape)}|{lanes}|".encode())
    elif isinstance(obj, Mapping):
        h.update(b"{")
        for key in sorted(obj, key=str):
            h.update(f"{key!s}:".encode())
            _update(h, obj[key], whole)
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(f"[{len(obj)}".encode())
        for value in obj:
            _update(h, value, whole)
        h.update(b"]")
    elif obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        h.update(f"{type(obj).__name__}|{obj!r}|".encode())
    elif isinstance(obj, np.ndarray):
        _update(h, torch.from_numpy(np.ascontiguousarray(obj)), whole)
    else:  # an object the probe cannot look into: its type, so that two runs still agree
        h.update(f"<{type(obj).__module__}.{type(obj).__qualname__}>".encode())


def digest(obj: Any, whole: Mapping[int, str] | None = None) -> str:
    """The digest of a tensor or a nested dict/list/tuple of tensors and plain values: 32 hex digits.

    A ``DTensor`` counts with this rank's shard, unless ``whole`` (from :func:`whole_digests`) holds its whole
    tensor's lanes: then the digest is the one a single process holding the whole tensor computes.

    Examples:
        >>> _ = torch.manual_seed(0)
        >>> x = torch.randn(3)
        >>> digest(x) == digest(x.clone()), digest(x) == digest(x.double())
        (True, False)
        >>> y = x.clone()
        >>> y[0] = torch.nextafter(y[0], torch.tensor(1.0))
        >>> digest(x) == digest(y)
        False
    """
    h = hashlib.sha256()  # with the CPU's SHA instructions about twice as fast as blake2b here
    _update(h, obj, whole or {})
    return h.hexdigest()[:32]


def whole_digests(obj: Any) -> dict[int, str]:
    """The whole tensor's lanes of every ``DTensor`` in ``obj``, by ``id``, for :func:`digest`.

    A collective over the tensors' meshes when ``obj`` holds a ``DTensor`` (every rank calls it with the same
    structure: a model's parameters, gradients or optimizer state); nothing otherwise.
    """
    sharded = [t for t in tensors_in(obj) if is_dtensor(t)]
    return dict(zip(map(id, sharded), digests(sharded), strict=True)) if sharded else {}


def whole_norms(tensors: list[torch.Tensor]) -> list[float | None]:
    """:func:`norm` of each whole tensor; a ``DTensor``'s from its owners' shards (one collective for all of them)."""
    sharded = [t for t in tensors if is_dtensor(t) and t.is_floating_point() and t.numel()]
    found = dict(zip(map(id, sharded), full_norms(sharded), strict=True)) if sharded else {}
    return [found[id(t)] if id(t) in found else None if is_dtensor(t) else norm(t) for t in tensors]


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """The tensors of a nested structure, in a fixed order (dict keys sorted).

    Examples:
        >>> [t.tolist() for t in tensors_in({"b": torch.ones(1), "a": (torch.zeros(1), 3)})]
        [[0.0], [1.0]]
    """
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [t for key in sorted(obj, key=str) for t in tensors_in(obj[key])]
    if isinstance(obj, (list, tuple)):
        return [t for value in obj for t in tensors_in(value)]
    return []


def norm(obj: Any) -> float | None:
    """The float64 L2 norm over every floating-point tensor of ``obj`` (None when it holds none).

    Examples:
        >>> norm((torch.tensor([3.0]), torch.tensor([4.0]), torch.tensor([1])))
        5.0
    """
    norms = [
        torch.linalg.vector_norm(t.detach(), dtype=torch.float64)
        for t in tensors_in(obj)
        if t.is_floating_point() and t.numel()
    ]
    if not norms:
        return None
    return float(torch.linalg.vector_norm(torch.stack(norms)))


def sample_summary(batch: Any) -> dict[str, Any]:
    """The batch as a multiset of samples: their count and the sum (mod 2**64) of one hash per sample.

    Sample ``i`` is row ``i`` of every tensor with a leading dimension of the batch's length. The sum does not depend
    on the order of the samples, nor on how a step's samples are split into micro-batches or over processes: two
    runs that cut the same step differently have the same sum over the step.

    Examples:
        >>> x = torch.arange(6.0).reshape(3, 2)
        >>> sample_summary((x, torch.tensor([0, 1, 2]))) == sample_summary((x[[2, 0, 1]], torch.tensor([2, 0, 1])))
        True
    """
    tensors = [t.detach().cpu() for t in tensors_in(batch) if t.dim() > 0]
    if not tensors:
        return {"count": 0, "sum": "0" * 16}
    length = tensors[0].shape[0]
    rows = [t.contiguous() for t in tensors if t.shape[0] == length]
    total = 0
    for i in range(length):
        h = hashlib.blake2b(digest_size=8)
        for t in rows:
            h.update(f"{t.dtype}|{tuple(t.shape[1:])}|".encode())
            if t[i].numel():
                h.update(t[i].reshape(-1).view(torch.uint8).numpy().data)
        total = (total + int.from_bytes(h.digest(), "little")) & _MASK
    return {"count": int(length), "sum": f"{total:016x}"}


def add_summaries(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """The multiset of several batches (a whole step) from their :func:`sample_summary`.

    Examples:
        >>> a, b = torch.arange(4.0).reshape(4, 1), torch.arange(4.0, 8.0).reshape(4, 1)
        >>> add_summaries([sample_summary(a), sample_summary(b)]) == sample_summary(torch.cat([b, a]))
        True
    """
    total = sum(int(s["sum"], 16) for s in summaries) & _MASK
    return {"count": sum(int(s["count"]) for s in summaries), "sum": f"{total:016x}"}


def _bytes_digest(*parts: bytes | memoryview) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
    return h.hexdigest()[:32]


def rng_digests(generators: Mapping[str, torch.Generator] | None = None) -> dict[str, str]:
    """A digest of every global random state: ``python``, ``numpy``, ``torch`` (CPU), ``cuda:i``; plus ``generators``.

    ~20 µs on a CPU: cheap enough to take at the entry and the exit of every module.

    Examples:
        >>> _ = torch.manual_seed(0)
        >>> before = rng_digests()
        >>> _ = torch.rand(1)
        >>> after = rng_digests()
        >>> before["torch"] == after["torch"], before["python"] == after["python"]
        (False, True)
    """
    version, words, gauss = random.getstate()
    out = {"python": _bytes_digest(array("Q", words).tobytes(), repr((version, gauss)).encode())}
    key, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    out["numpy"] = _bytes_digest(np.asarray(keys).tobytes(), repr((key, pos, has_gauss, cached)).encode())
    out["torch"] = _bytes_digest(torch.get_rng_state().numpy().data)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i in range(torch.cuda.device_count()):
            out[f"cuda:{i}"] = _bytes_digest(torch.cuda.get_rng_state(i).numpy().data)
    for name, gen in (generators or {}).items():
        out[name] = _bytes_digest(gen.get_state().numpy().data)
    return out


__all__ = ["add_summaries", "digest", "norm", "rng_digests", "sample_summary", "tensors_in"]
