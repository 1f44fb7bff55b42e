"""torch's activation checkpointing, wrapped so that a recomputed forward can replay state torch does not keep.

``torch.utils.checkpoint`` (both modes, and everything built on it: ``checkpoint_wrapper``,
``apply_activation_checkpointing``, selective checkpointing through ``context_fn``, the composable
``checkpoint(module)``) stashes the default CPU and CUDA generators when a checkpointed forward starts and puts them
back for its recomputation. Any other stream — an RNG tracker's, a named generator — has moved on by then, so a
recomputed dropout draws another mask than the forward applied, and the backward silently uses it. torch has no hook
for this; the two places every form passes through are wrapped here:

- ``CheckpointFunction.forward`` (``use_reentrant=True``): its ``run_function`` runs once in the forward and again,
  from ``ctx``, in the backward;
- the non-reentrant generator (``use_reentrant=False``, in ``torch.utils.checkpoint`` and, imported by name, in
  ``torch.distributed._composable.checkpoint_activation``): its ``fn`` runs only for the recomputation. Up to torch
  2.13 it is ``_checkpoint_without_reentrant_generator(fn, preserve_rng_state, ...)``; from 2.14 every form calls
  ``_checkpoint_without_reentrant_generator_impl(fn, args, kwargs, *, preserve_rng_state, ...)`` and the old name is a
  shim over it, so the new one is wrapped where it exists (and only it: a call through the shim is wrapped once).

torch's public ``checkpoint(..., context_fn=...)`` enters a context manager around the recomputation, but only for the
non-reentrant calls that pass one, and selective checkpointing already uses it for its own: it cannot reach the
checkpointing a model or a library does, so the private functions are still wrapped.

Either way the function is replaced by one that, on every recomputation, enters the context manager the installed
``snapshot`` callable returned when the checkpointed forward started. ``preserve_rng_state=False`` is honoured: then
nothing is replayed, as torch replays nothing. The names are checked at import (:mod:`._compat.checks`).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

Snapshot = Callable[[], "AbstractContextManager[Any] | None"]
"""Called when a checkpointed forward starts: what to enter around each of its recomputations (``None``: nothing)."""

_REENTRANT = "torch.utils.checkpoint"
_GENERATOR_MODULES = ("torch.utils.checkpoint", "torch.distributed._composable.checkpoint_activation")
_GENERATOR = "_checkpoint_without_reentrant_generator"
_GENERATOR_IMPL = "_checkpoint_without_reentrant_generator_impl"  # torch 2.14 and newer

_snapshots: list[Snapshot] = []
_originals: dict[str, Any] = {}


class _Recomputed:
    """``fn``, with the forward-time snapshot entered around every call that recomputes the forward."""

    __slots__ = ("_fn", "_forward_pending", "_replay")

    def __init__(self, fn: Callable[..., Any], replay: AbstractContextManager[Any], forward_pending: bool) -> None:
        self._fn = fn
        self._replay = replay
        self._forward_pending = forward_pending  # reentrant: the first call is the forward itself

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._forward_pending:
            self._forward_pending = False
            return self._fn(*args, **kwargs)
        with self._replay:
            return self._fn(*args, **kwargs)


def _replay() -> AbstractContextManager[Any] | None:
    """The installed snapshot, taken now (``None`` when there is nothing of the package's to replay)."""
    return _snapshots[0]() if _snapshots else None


def _wrap(fn: Callable[..., Any], preserve_rng_state: bool, forward_pending: bool) -> Callable[..., Any]:
    if not preserve_rng_state:
        return fn
    replay = _replay()
    return fn if replay is None else _Recomputed(fn, replay, forward_pending)


def _reentrant_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    def forward(ctx: Any, run_function: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:
        return original(ctx, _wrap(run_function, preserve_rng_state, True), preserve_rng_state, *args)

    forward.__wrapped__ = original  # type: ignore[attr-defined]
    return forward


def _non_reentrant(original: Callable[..., Any]) -> Callable[..., Any]:
    def generator(fn: Callable[..., Any], preserve_rng_state: bool = True, *args: Any, **kwargs: Any) -> Any:
        return original(_wrap(fn, preserve_rng_state, False), preserve_rng_state, *args, **kwargs)

    generator.__wrapped__ = original  # type: ignore[attr-defined]
    return generator


def _non_reentrant_impl(original: Callable[..., Any]) -> Callable[..., Any]:
    def impl(fn: Callable[..., Any], *args: Any, preserve_rng_state: bool = True, **kwargs: Any) -> Any:
        return original(_wrap(fn, preserve_rng_state, False), *args, preserve_rng_state=preserve_rng_state, **kwargs)

    impl.__wrapped__ = original  # type: ignore[attr-defined]
    return impl


def generator_name(module: Any) -> str | None:
    """The non-reentrant generator every checkpointing form calls in ``module`` (``None``: neither name is there)."""
    for name in (_GENERATOR_IMPL, _GENERATOR):
        if hasattr(module, name):
            return name
    return None


def install(snapshot: Snapshot) -> None:
    """Replay what ``snapshot()`` returns in every recomputation of a checkpointed forward (idempotent).

    Imports ``torch.utils.checkpoint`` and the composable ``checkpoint`` module, so that they are wrapped before any
    model code binds them.
    """
    _snapshots[:] = [snapshot]
    if _originals:
        return
    reentrant = importlib.import_module(_REENTRANT).CheckpointFunction
    _originals["reentrant"] = reentrant.__dict__["forward"]
    reentrant.forward = staticmethod(_reentrant_forward(reentrant.forward))
    for name in _GENERATOR_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # pragma: no cover  (a torch built without distributed)
            continue
        function = generator_name(module)
        if function is None:  # pragma: no cover  (checks.PIECES refuses such a torch first)
            continue
        wrapper = _non_reentrant_impl if function == _GENERATOR_IMPL else _non_reentrant
        _originals[name] = (function, getattr(module, function))
        setattr(module, function, wrapper(_originals[name][1]))


def uninstall() -> None:
    """Put torch's own functions back."""
    if not _originals:
        return
    sys.modules[_REENTRANT].CheckpointFunction.forward = _originals.pop("reentrant")
    for name, (function, original) in _originals.items():
        setattr(sys.modules[name], function, original)
    _originals.clear()
    _snapshots.clear()


def in_backward() -> bool:
    """Whether this thread runs inside an autograd backward pass (where a checkpointed forward is recomputed).

    ``torch._C._current_autograd_node()`` is the node the engine is running, ``None`` outside a backward pass; a torch
    without it answers ``False`` (nothing can be told).
    """
    import torch

    current = getattr(torch._C, "_current_autograd_node", None)
    return current is not None and current() is not None


def installed() -> bool:
    """Whether checkpointed forwards replay the package's streams."""
    return bool(_originals)


__all__ = ["Snapshot", "generator_name", "in_backward", "install", "installed", "uninstall"]
