"""Fingerprints: one sha256 that says whether two models, optimizers or tensor collections are bitwise equal.

This module is a leaf: it knows torch, not Lightning.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor / FSDP2) tensor as its full value; anything else as it is."""
    full = getattr(tensor, "full_tensor", None)
    return full() if callable(full) else tensor


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

    The same on every rank and run for equal contents; different when any bit differs. Sharded parameters
    (``DTensor``, FSDP2) are hashed as their full tensors (a collective: call it on every rank).

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
    digest = hashlib.sha256()
    for name, value in sorted(named_tensors(obj).items()):
        digest.update(name.encode())
        if isinstance(value, torch.Tensor):
            tensor = _full(value).detach().cpu().contiguous()
            digest.update(f"|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
        else:
            digest.update(f"|{type(value).__name__}|{value!r}|".encode())
    return digest.hexdigest()


def tensor_fingerprints(obj: Any) -> dict[str, str]:
    """One fingerprint per tensor, by name: which parameter differs, not only that something does.

    Examples:
        >>> sorted(tensor_fingerprints(torch.nn.Linear(2, 1)))
        ['bias', 'weight']
    """
    return {name: fingerprint(value) for name, value in named_tensors(obj).items() if isinstance(value, torch.Tensor)}


__all__: Sequence[str] = ["fingerprint", "named_tensors", "tensor_fingerprints"]
