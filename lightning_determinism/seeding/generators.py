"""Named generators: one cached, separately seeded ``torch.Generator`` per purpose (and device), on every rank its own.

Drawing from one (``torch.rand(..., generator=generator("noise"))``) touches no global stream. Their states travel in
:func:`~lightning_determinism.seeding.rng.capture_rng_state` and are replayed in activation checkpointing's
recomputations (:mod:`~lightning_determinism.seeding.recompute`).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from lightning_determinism.seeding import recompute
from lightning_determinism.seeding.record import BASE_SEED_ENV
from lightning_determinism.seeding.seeds import derive_seed

_GENERATORS: dict[tuple[str, str], torch.Generator] = {}


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def generator(name: str, device: torch.device | str | None = None) -> torch.Generator:
    """A cached generator for one purpose, seeded with ``derive_seed(base, "generator", name, rank)``.

    Code that samples actions, noise or masks can draw from it (``torch.rand(..., generator=g)``) without touching
    the global state: reproducible, independent of everything else that draws, and cheaper than a fork. The base
    seed is the one :func:`~lightning_determinism.set_seed` or a deterministic strategy put in effect; its state is
    part of :func:`~lightning_determinism.seeding.rng.capture_rng_state`, and a checkpointed forward's
    recomputation draws from it what the forward drew (:mod:`~lightning_determinism.seeding.recompute`).

    Raises:
        RuntimeError: if no base seed is in effect yet.

    Examples:
        >>> from lightning_determinism import set_seed
        >>> _ = set_seed(3)
        >>> g = generator("noise")
        >>> g is generator("noise"), g.device.type
        (True, 'cpu')
    """
    if recompute._UNGUARDED[0]:  # torch lacks what the replay wraps: a recomputed draw is refused, not redrawn
        recompute.refuse_recomputation(f"generator({name!r})")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    key = (name, str(dev))
    cached = _GENERATORS.get(key)
    if cached is not None:
        return cached
    base = os.environ.get(BASE_SEED_ENV) or os.environ.get("PL_GLOBAL_SEED")
    if base is None:
        raise RuntimeError(
            f"generator({name!r}) needs a base seed: call `set_seed(...)` or run under a deterministic strategy"
        )
    gen = torch.Generator(device=dev)
    gen.manual_seed(derive_seed(int(base), "generator", name, _rank()))
    _GENERATORS[key] = gen
    return gen


def named_generator_states() -> dict[str, torch.Tensor]:
    """The states of the :func:`generator` instances, by ``"name@device"``."""
    return {f"{name}@{dev}": gen.get_state() for (name, dev), gen in _GENERATORS.items()}


def restore_named_generators(states: dict[str, torch.Tensor]) -> None:
    """Put back what :func:`named_generator_states` returned (creating generators that do not exist yet)."""
    for key, gen_state in states.items():
        name, _, dev = key.rpartition("@")
        gen = _GENERATORS.get((name, dev))
        if gen is None:
            gen = torch.Generator(device=dev)
            _GENERATORS[(name, dev)] = gen
        gen.set_state(gen_state)


def _snapshot() -> dict[tuple[str, str], torch.Tensor]:
    """Every generator's state (a copy: drawing changes a generator in place)."""
    return {key: gen.get_state() for key, gen in _GENERATORS.items()}


def _swap(states: dict[tuple[str, str], torch.Tensor]) -> dict[tuple[str, str], torch.Tensor]:
    """Put ``states`` into the generators; one made since they were taken starts again from its seed.

    Returns the states they replaced.
    """
    replaced = {}
    for key, gen in _GENERATORS.items():
        replaced[key] = gen.get_state()
        state = states.get(key)
        if state is None:
            gen.manual_seed(gen.initial_seed())
        else:
            gen.set_state(state)
    return replaced


# From the start, so that a generator first made inside a checkpointed block is replayed in its recomputation too.
recompute.register(_snapshot, _swap)

__all__ = ["generator", "named_generator_states", "restore_named_generators"]
