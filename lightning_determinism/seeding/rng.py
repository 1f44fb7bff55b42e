"""Every RNG state of a process as checkpoint-safe values, and named streams for model parallelism.

This module is a leaf: it knows torch and numpy, not Lightning's strategies.

- :func:`capture_rng_state` / :func:`restore_rng_state`: python ``random``, numpy's global RNG, torch CPU, every
  CUDA device, the tracker's streams and the isolated generators, as tensors, ints, floats, strings, lists and
  dicts only, so ``torch.load(weights_only=True)`` reads them back.
- :class:`RNGStatesTracker` and :func:`get_rng_tracker`: named streams that :meth:`RNGStatesTracker.fork` switches
  the default generator(s) to and back from (tensor-parallel dropout).
- :func:`generator`: a cached, separately seeded ``torch.Generator`` for one purpose
  (:mod:`~lightning_determinism.seeding.generators`).

The tracker's streams are replayed in activation checkpointing's recomputations
(:mod:`~lightning_determinism.seeding.recompute`): a fork inside a checkpointed block draws in the backward's
recomputation what it drew in the forward.
"""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_info

from lightning_determinism.seeding import recompute
from lightning_determinism.seeding.generators import (
    generator,
    named_generator_states,
    restore_named_generators,
)
from lightning_determinism.seeding.recompute import _UNGUARDED, refuse_recomputation
from lightning_determinism.seeding.record import BASE_SEED_ENV
from lightning_determinism.seeding.seeds import check_seed, derive_seed

DEFAULT_STREAM = "model-parallel-rng"


def cuda_ready() -> bool:
    """Whether CUDA is there and initialised (its generators then have states to save)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


class _Fork:
    """The context manager :meth:`RNGStatesTracker.fork` returns: one per stream, reused (cheaper than a generator).

    Nesting is counted per stream: a fork of the stream already active only deepens the count, since switching
    again would replay the stream's stored, stale state.
    """

    __slots__ = ("_cuda", "_depth", "_name", "_saved_cpu", "_saved_cuda", "_stream", "_tracker")

    def __init__(self, tracker: RNGStatesTracker, name: str) -> None:
        self._tracker = tracker
        self._name = name
        self._depth = 0
        # The stream's state dict, looked up once (the tracker resets it when it replaces its states).
        self._stream: dict[str, torch.Tensor] | None = tracker._states.get(name)
        self._cuda = self._stream is not None and "cuda" in self._stream
        self._saved_cuda: torch.Tensor | None = None

    def __enter__(self) -> None:
        if self._depth:
            self._depth += 1
            return
        if _UNGUARDED[0]:  # torch lacks what the replay wraps: a recomputed fork is refused, never silently redrawn
            refuse_recomputation(f"the RNG tracker's stream {self._name!r}")
        stream = self._stream
        if stream is None:
            stream = self._stream = self._tracker._untracked(self._name)  # added after this fork was made
            self._cuda = "cuda" in stream
        self._depth = 1
        self._saved_cpu = _get_cpu_state()
        _set_cpu_state(stream["cpu"])
        if self._cuda and cuda_ready():
            self._saved_cuda = torch.cuda.get_rng_state()
            torch.cuda.set_rng_state(stream["cuda"])

    def __exit__(self, exc_type: object, exc: object, traceback: object) -> None:  # no *args: a fork is µs
        depth = self._depth - 1
        self._depth = depth
        if depth:
            return
        stream: dict[str, torch.Tensor] = self._stream  # type: ignore[assignment]  # set by __init__ or __enter__
        stream["cpu"] = _get_cpu_state()  # the advanced state: the next fork continues the sequence
        _set_cpu_state(self._saved_cpu)
        if self._saved_cuda is not None:
            stream["cuda"] = torch.cuda.get_rng_state()
            torch.cuda.set_rng_state(self._saved_cuda)
            self._saved_cuda = None


_CPU = torch.default_generator
_get_cpu_state, _set_cpu_state = _CPU.get_state, _CPU.set_state  # bound once: a fork is a few µs, lookups count


def _seeded(seed: int) -> dict[str, torch.Tensor]:
    """A stream's state at its start: the CPU generator's and, with CUDA, the current device's."""
    state = {"cpu": torch.Generator().manual_seed(seed).get_state()}
    if torch.cuda.is_available():
        device = torch.cuda.current_device()
        state["cuda"] = torch.Generator(device=f"cuda:{device}").manual_seed(seed).get_state()
    return state


class RNGStatesTracker:
    """Named RNG streams that ``fork()`` swaps into the default generator(s) and back.

    Tracks the CPU generator, and the current CUDA device's generator when CUDA is available. Seeds are checked
    for duplicates: two streams with one seed would draw the same numbers.

    Examples:
        >>> tracker = RNGStatesTracker()
        >>> tracker.add("model-parallel-rng", 1234)
        >>> _ = torch.manual_seed(0)
        >>> with tracker.fork():
        ...     inside = torch.rand(2)
        >>> outside = torch.rand(2)  # the caller's stream went on as if nothing happened
        >>> torch.equal(outside, torch.rand(2, generator=torch.Generator().manual_seed(0)))
        True
        >>> torch.equal(inside, torch.rand(2, generator=torch.Generator().manual_seed(1234)))
        True
    """

    def __init__(self) -> None:
        self._states: dict[str, dict[str, torch.Tensor]] = {}
        self._seeds: dict[str, int] = {}
        self._forks: dict[str, _Fork] = {}

    def __contains__(self, name: object) -> bool:
        return name in self._states

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._seeds!r})"

    @property
    def seeds(self) -> dict[str, int]:
        """The seed each stream was registered with."""
        return dict(self._seeds)

    def reset(self) -> None:
        """Forget every stream."""
        self._states.clear()
        self._seeds.clear()
        self._drop_forks()

    def _drop_forks(self) -> None:
        """Forks already handed out (kept, one per name) look their stream up again at their next entry."""
        for fork in self._forks.values():
            if not fork._depth:  # an open fork keeps the stream it entered, to save it back at its exit
                fork._stream = None

    def add(self, name: str, seed: int) -> None:
        """Register stream ``name`` seeded with ``seed``, without touching the caller's RNG.

        Raises:
            TypeError: if ``name`` is not a string or ``seed`` not an int.
            ValueError: if ``name`` or ``seed`` is already tracked, or ``seed`` is out of range.
        """
        if not isinstance(name, str):
            raise TypeError(f"`name` must be a str, got {name!r}")
        seed = check_seed(seed)
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} is already tracked (seed {self._seeds[name]})")
        for other, other_seed in self._seeds.items():
            if other_seed == seed:
                raise ValueError(f"seed {seed} of RNG stream {name!r} is already used by stream {other!r}")
        self._states[name] = _seeded(seed)
        self._seeds[name] = seed

    def _untracked(self, name: str) -> dict[str, torch.Tensor]:
        """The stream a fork enters; the default one, outside model parallelism, this rank's own from the base seed."""
        stream = self._states.get(name)
        if stream is not None:
            return stream
        base = os.environ.get(BASE_SEED_ENV) or os.environ.get("PL_GLOBAL_SEED")
        if name != DEFAULT_STREAM or base is None:
            raise RuntimeError(
                f"RNG stream {name!r} is not tracked; register it with `get_rng_tracker().add({name!r}, seed)` or call"
                " `model_parallel_seed(seed, topology)` first"
                + ("" if name != DEFAULT_STREAM else " (or seed the run: `set_seed`, a deterministic strategy)")
            )
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.add(name, derive_seed(int(base), "tracker", name, rank))
        rank_zero_info(
            f"lightning_determinism: RNG stream {name!r} is not set up by model parallelism; `fork()` draws from a"
            " stream of each rank's own, derived from the base seed (as one process or DDP would)"
        )
        return self._states[name]

    def _snapshot(self) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, tuple[Any, ...]]]:
        """The streams and the forks' bookkeeping now, for a checkpointed forward's recomputation.

        Shallow: a fork replaces a stream's state tensors at its exit and never writes into them.
        """
        forks = {
            name: (fork._depth, getattr(fork, "_saved_cpu", None), fork._saved_cuda)
            for name, fork in self._forks.items()
        }
        return {name: dict(state) for name, state in self._states.items()}, forks

    def _swap(
        self, snapshot: tuple[dict[str, dict[str, torch.Tensor]], dict[str, tuple[Any, ...]]]
    ) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, tuple[Any, ...]]]:
        """Put a :meth:`_snapshot` in place (the stream dicts keep their identity: open forks hold them).

        A stream added since the snapshot (a first fork inside the checkpointed block) starts again from its seed.
        A fork that was open when the snapshot was taken is open again, so a nested fork of its stream draws from
        the default generator, which torch restored; one opened since is closed for as long as the snapshot is in.
        """
        current = self._snapshot()
        streams, forks = snapshot
        for name, live in self._states.items():
            saved = streams.get(name)
            live.clear()
            live.update(saved if saved is not None else _seeded(self._seeds[name]))
        for name, fork in self._forks.items():
            fork._depth, fork._saved_cpu, fork._saved_cuda = forks.get(name, (0, None, None))
        return current

    def fork(self, name: str = DEFAULT_STREAM) -> _Fork:
        """Draw from stream ``name`` inside the ``with`` block; the caller's stream is restored after it.

        The stream's advanced state is kept, so the next fork continues its sequence; forks of different streams
        nest, and a fork of the stream already active is a no-op.

        Raises:
            RuntimeError: on entering, if ``name`` is not tracked.
        """
        try:
            return self._forks[name]
        except KeyError:  # the first fork of this name (a subscript is cheaper than .get() on every later one)
            fork = self._forks[name] = _Fork(self, name)
            return fork

    def get_states(self) -> dict[str, dict[str, torch.Tensor]]:
        """Every stream's state and seed, as tensors (checkpoint-safe)."""
        return {
            name: {**{k: v.clone() for k, v in state.items()}, "seed": torch.tensor(self._seeds[name])}
            for name, state in self._states.items()
        }

    def set_states(self, states: dict[str, dict[str, torch.Tensor]]) -> None:
        """Replace every stream by ``states`` (from :meth:`get_states`).

        Raises:
            ValueError: if an entry misses its ``cpu`` state or ``seed``.
        """
        new_states, new_seeds = {}, {}
        for name, state in states.items():
            missing = [key for key in ("cpu", "seed") if key not in state]
            if missing:
                raise ValueError(f"RNG stream {name!r} misses {missing} in the states given to set_states()")
            new_seeds[name] = int(state["seed"])
            new_states[name] = {k: v.clone() for k, v in state.items() if k != "seed"}
        self._states, self._seeds = new_states, new_seeds
        self._drop_forks()


_TRACKER = RNGStatesTracker()
# From the start, so that a stream first forked inside a checkpointed block is replayed in its recomputation too.
recompute.register(_TRACKER._snapshot, _TRACKER._swap)


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker that :func:`~lightning_determinism.parallel.topology.model_parallel_seed` sets up.

    Examples:
        >>> get_rng_tracker() is get_rng_tracker()
        True
    """
    return _TRACKER


def _python_state() -> dict[str, Any]:
    version, words, gauss = random.getstate()
    return {"version": version, "state": torch.tensor(words, dtype=torch.int64), "gauss": gauss}


def _numpy_state() -> dict[str, Any]:
    key, words, pos, has_gauss, cached = np.random.get_state()  # type: ignore[misc]
    return {
        "key": str(key),
        "state": torch.from_numpy(np.asarray(words, dtype=np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }


def capture_cpu_streams() -> dict[str, Any]:
    """The three global CPU streams (python ``random``, numpy, torch) as checkpoint-safe values.

    Examples:
        >>> state = capture_cpu_streams()
        >>> a = torch.rand(2)
        >>> restore_cpu_streams(state)
        >>> torch.equal(a, torch.rand(2))
        True
    """
    return {"python": _python_state(), "numpy": _numpy_state(), "torch": torch.get_rng_state()}


def restore_cpu_streams(state: dict[str, Any]) -> None:
    """Put back what :func:`capture_cpu_streams` (or :func:`capture_rng_state`) returned for the CPU streams.

    Raises:
        KeyError: naming the first missing key.
    """
    for key in ("python", "numpy", "torch"):
        if key not in state:
            raise KeyError(f"RNG state misses {key!r}; it has {sorted(state)}")
    py = state["python"]
    random.setstate((int(py["version"]), tuple(int(w) for w in py["state"].tolist()), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state(
        (npy["key"], npy["state"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])


def capture_rng_state() -> dict[str, Any]:
    """Every RNG state of this process, as values ``torch.load(weights_only=True)`` accepts.

    Keys: ``python``, ``numpy``, ``torch`` (CPU), ``cuda`` (one state per device, empty without CUDA),
    ``tracker`` (:meth:`RNGStatesTracker.get_states` of :func:`get_rng_tracker`) and ``generators`` (the
    :func:`generator` states by ``"name@device"``).

    Examples:
        >>> _ = torch.manual_seed(0)
        >>> state = capture_rng_state()
        >>> a = torch.rand(3)
        >>> restore_rng_state(state)
        >>> torch.equal(a, torch.rand(3))
        True
    """
    return {
        **capture_cpu_streams(),
        "cuda": list(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else [],
        "tracker": _TRACKER.get_states(),
        "generators": named_generator_states(),
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back what :func:`capture_rng_state` returned.

    Raises:
        KeyError: naming the first missing key.
    """
    restore_cpu_streams(state)
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    if "tracker" in state:
        _TRACKER.set_states(state["tracker"])
    restore_named_generators(state.get("generators") or {})


__all__ = [
    "DEFAULT_STREAM",
    "RNGStatesTracker",
    "capture_cpu_streams",
    "capture_rng_state",
    "cuda_ready",
    "generator",
    "get_rng_tracker",
    "named_generator_states",
    "restore_cpu_streams",
    "restore_named_generators",
    "restore_rng_state",
]
