"""Fingerprints: one sha256 that says whether two models, optimizers or tensor collections are bitwise equal.

Each tensor enters as its dtype, shape and sharding-invariant digest (:mod:`.tensor_digest`), computed where it
lives: a sharded model (FSDP2, tensor parallel) is fingerprinted shard by shard, without gathering a parameter, to
the value one process gets for the same tensors. This module knows torch, not Lightning.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_determinism.divergence.tensor_digest import digests


def _flatten(obj: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            _flatten(value, f"{prefix}.{key}" if prefix else str(key), out)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            _flatten(value, f"{prefix}.{i}" if prefix else str(i), out)
    elif obj is None or isinstance(obj, (bool, int, float, str)):
        out[prefix] = obj
    else:
        raise TypeError(f"fingerprint() cannot hash a {type(obj).__name__} at {prefix or 'the top level'!r}")


def named_tensors(obj: Any) -> dict[str, Any]:
    """Flatten a module, a ``state_dict``, an optimizer or a nested collection into ``{dotted name: value}``.

    Examples:
        >>> sorted(named_tensors(torch.nn.Linear(2, 1)))
        ['bias', 'weight']
    """
    if isinstance(obj, nn.Module):
        obj = obj.state_dict()
    elif isinstance(obj, torch.optim.Optimizer):
        obj = obj.state_dict()
    out: dict[str, Any] = {}
    _flatten(obj, "", out)
    return out


def fingerprint(obj: Any) -> str:
    """sha256 over every tensor (and plain value) of ``obj``: names sorted, then dtype, shape and bytes.

    The same on every rank and run for equal contents; different when any bit differs (see :mod:`.tensor_digest`
    for the bound on collisions). Sharded parameters (``DTensor``: FSDP2, tensor parallel) are digested shard by
    shard, never gathered, and give what the same tensors give on one process (a collective: call it on every
    rank).

    Args:
        obj: a ``nn.Module`` (its ``state_dict``), an optimizer (its ``state_dict``), a tensor, or a dict/list/tuple
            of tensors and plain values.

    Raises:
        TypeError: for a value that is neither a tensor nor a plain python value.

    Examples:
        >>> _ = torch.manual_seed(0)
        >>> a = torch.nn.Linear(3, 2)
        >>> b = torch.nn.Linear(3, 2)
        >>> b.load_state_dict(a.state_dict())
        <All keys matched successfully>
        >>> fingerprint(a) == fingerprint(b)
        True
        >>> with torch.no_grad():
        ...     b.weight.view(-1)[0] = torch.nextafter(b.weight.view(-1)[0], torch.tensor(1.0))
        >>> fingerprint(a) == fingerprint(b)
        False
    """
    return _fingerprint(sorted(named_tensors(obj).items()))


def _fingerprint(items: list[tuple[str, Any]]) -> str:
    tensors = [value for _, value in items if isinstance(value, torch.Tensor)]
    found = iter(digests(tensors))
    digest = hashlib.sha256()
    for name, value in items:
        digest.update(name.encode())
        if isinstance(value, torch.Tensor):
            digest.update(f"|{value.dtype}|{tuple(value.shape)}|{next(found)}|".encode())
        else:
            digest.update(f"|{type(value).__name__}|{value!r}|".encode())
    return digest.hexdigest()


def tensor_fingerprints(obj: Any) -> dict[str, str]:
    """One fingerprint per tensor, by name: which parameter differs, not only that something does.

    Examples:
        >>> sorted(tensor_fingerprints(torch.nn.Linear(2, 1)))
        ['bias', 'weight']
    """
    named = [(name, value) for name, value in named_tensors(obj).items() if isinstance(value, torch.Tensor)]
    found = iter(digests([value for _, value in named]))  # one collective for all sharded tensors
    return {name: _fingerprint_of_digest(value, next(found)) for name, value in named}


def _fingerprint_of_digest(tensor: torch.Tensor, digest: str) -> str:
    """What :func:`fingerprint` gives for ``tensor`` alone, from its digest."""
    return hashlib.sha256(f"|{tensor.dtype}|{tuple(tensor.shape)}|{digest}|".encode()).hexdigest()


__all__: Sequence[str] = ["fingerprint", "named_tensors", "tensor_fingerprints"]
