"""Activation checkpointing keeps every stream the package owns: a recomputed forward draws what the forward drew.

torch's checkpointing puts the default generators back for a recomputation, nothing else. The package's own streams
— the :class:`~lightning_determinism.seeding.rng.RNGStatesTracker`'s (``with get_rng_tracker().fork(): dropout(h)``,
the tensor-parallel pattern) and the named :func:`~lightning_determinism.seeding.generators.generator` instances —
register here as *owners*: a ``snapshot()`` of their state and a ``swap(state)`` that puts a state in and returns
the one it replaced (a stream made after the snapshot — a first fork inside the block — starts again from its
seed). When a checkpointed forward starts, every owner's snapshot is taken; each recomputation of that forward swaps
the snapshots in and, after it, the states of the moment back. Without the
replay the recomputed dropout draws the next mask of its stream, and the gradients are those of a mask the forward
never applied. The hook into torch is :mod:`lightning_determinism._compat.checkpointing`, installed by the first
registration: the process-wide tracker and the named generators register when their modules are imported, so a
stream first made inside a checkpointed block is replayed too. A snapshot is a few dict copies (µs per block).

Everything else needs nothing: the default generators (and so the invariant mode's micro-batch seeds and the DTensor
random ops, which draw from the current stream) are torch's to restore.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_determinism._compat import checkpointing
from lightning_determinism._compat.checks import available, missing, versions
from lightning_determinism._compat.features import FEATURES, RECOMPUTE
from lightning_determinism.errors import IncompatibleVersionError

SnapshotFn = Callable[[], Any]
SwapFn = Callable[[Any], Any]

_OWNERS: list[tuple[SnapshotFn, SwapFn]] = []
_UNGUARDED: list[bool] = [False]  # True where torch lacks what the replay wraps: recomputations are refused instead


class _Replay:
    """The owners' states when a checkpointed forward started, swapped in around each of its recomputations."""

    __slots__ = ("_outer", "_states")

    def __init__(self, states: list[tuple[SwapFn, Any]]) -> None:
        self._states = states
        self._outer: list[list[Any]] = []  # a stack: a recomputation may run inside another's

    def __enter__(self) -> None:
        self._outer.append([swap(state) for swap, state in self._states])

    def __exit__(self, *exc: object) -> None:
        outer = self._outer.pop()
        for (swap, _), state in zip(reversed(self._states), reversed(outer), strict=True):
            swap(state)


def snapshot() -> _Replay | None:
    """Every owner's state now, to replay in a recomputation; ``None`` when no owner holds any."""
    states = []
    for take, swap in _OWNERS:
        state = take()
        if state is not None:
            states.append((swap, state))
    return _Replay(states) if states else None


def register(take: SnapshotFn, swap: SwapFn) -> None:
    """Replay an owner's state in every recomputation of a checkpointed forward from now on (idempotent).

    Args:
        take: returns the owner's state (``None`` when it holds none); called when a checkpointed forward starts.
        swap: puts a state from ``take`` in and returns the one it replaced.

    Examples:
        >>> import torch
        >>> from torch.utils.checkpoint import checkpoint
        >>> g = torch.Generator().manual_seed(0)
        >>> def swap(state):
        ...     old = g.get_state()
        ...     g.set_state(state)
        ...     return old
        >>> register(g.get_state, swap)
        >>> drawn = []
        >>> def noisy(x):
        ...     drawn.append(torch.rand(2, generator=g))
        ...     return x * drawn[-1].sum()
        >>> x = torch.ones(2, requires_grad=True)
        >>> checkpoint(noisy, x, use_reentrant=False).sum().backward()
        >>> torch.equal(drawn[0], drawn[1])  # the recomputation drew the forward's numbers
        True
        >>> unregister(g.get_state)
    """
    if all(owner[0] != take for owner in _OWNERS):
        _OWNERS.append((take, swap))
    if available(RECOMPUTE):
        checkpointing.install(snapshot)
    else:  # no replay here: a recomputation that draws from a package stream is refused (refuse_recomputation)
        _UNGUARDED[0] = True


def refuse_recomputation(stream: str) -> None:
    """Refuse a draw from a package stream inside a backward pass where the replay could not be installed.

    Such a draw is a checkpointed forward's recomputation (or, rarely, a custom backward): without the replay it would
    draw another mask than the forward applied, and the gradients would silently differ. Free where the replay is
    installed (one list lookup).

    Raises:
        IncompatibleVersionError: in one line, naming the stream, the installed versions and where the replay works.
    """
    if _UNGUARDED[0] and checkpointing.in_backward():
        names = "; ".join(piece.name.split(" (")[0] for piece in missing(RECOMPUTE))
        raise IncompatibleVersionError(
            f"lightning_determinism: {stream} was drawn from in a recomputed (activation-checkpointed) forward, and"
            f" {RECOMPUTE} cannot run with the installed {versions()} ({names} missing or changed; it works with"
            f" {FEATURES[RECOMPUTE]}): the recomputation would draw other numbers than the forward did"
        )


def unregister(take: SnapshotFn) -> None:
    """Stop replaying the owner registered with ``take``."""
    _OWNERS[:] = [owner for owner in _OWNERS if owner[0] != take]


__all__ = ["refuse_recomputation", "register", "snapshot", "unregister"]
