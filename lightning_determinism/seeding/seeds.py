"""Seeds: range checks, the rank-0 broadcast, the ``seed + rank`` offset and derived seeds.

This module is a leaf: it knows ``torch.distributed`` but nothing of Lightning's strategies.
"""

from __future__ import annotations

import hashlib
import numbers
import os
import random
import secrets
from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch
import torch.distributed as dist

from lightning_determinism._process import _rank_and_world_size
from lightning_determinism.seeding._hash import EMPTY, State, absorb, first_word
from lightning_determinism.seeding.backends import DebugMode, configure_determinism
from lightning_determinism.seeding.record import _record_seeds, current_seeds

MAX_SEED = 2**32 - 1
"""Largest seed numpy's legacy global RNG accepts; python and torch accept it too."""


_PL_GLOBAL_SEED = "PL_GLOBAL_SEED"


def check_seed(seed: object, world_size: int = 1, name: str = "seed") -> int:
    """Return ``seed`` as an ``int`` if every rank's ``seed + rank`` stays a valid seed.

    Args:
        seed: the candidate; python and numpy integers are accepted, ``bool`` is not.
        world_size: number of processes that will add their rank to it.
        name: the argument's name, for the error message.

    Returns:
        The seed as a plain ``int``.

    Raises:
        TypeError: if ``seed`` is not an integer.
        ValueError: if ``seed`` is outside ``[0, 2**32 - 1 - (world_size - 1)]``.

    Examples:
        >>> check_seed(42, world_size=2)
        42
        >>> check_seed(2**32 - 1, world_size=2)
        Traceback (most recent call last):
        ...
        ValueError: `seed` must be in [0, 4294967294] for world_size=2, got 4294967295
    """
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"`{name}` must be an int in [0, {MAX_SEED - (world_size - 1)}], got {seed!r}")
    hi = MAX_SEED - (world_size - 1)
    value = int(seed)
    if not 0 <= value <= hi:
        raise ValueError(f"`{name}` must be in [0, {hi}] for world_size={world_size}, got {value}")
    return value


def draw_seed(world_size: int = 1) -> int:
    """Draw a fresh seed from OS entropy, valid for ``world_size`` ranks.

    OS entropy, not torch's RNG: that one may already be seeded, and every process would draw the same.

    Examples:
        >>> 0 <= draw_seed(world_size=8) <= 2**32 - 8
        True
    """
    return secrets.randbelow(MAX_SEED - (world_size - 1) + 1)


def broadcast_seed(seed: int, src: int = 0) -> int:
    """Send ``seed`` from rank ``src`` to every rank of the default process group.

    Without an initialised process group the seed is returned unchanged.

    Examples:
        >>> broadcast_seed(7)  # no process group: nothing to agree with
        7
    """
    if not (dist.is_available() and dist.is_initialized()):
        return seed
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    buf = torch.tensor([seed], dtype=torch.int64, device=device)
    dist.broadcast(buf, src=src)
    return int(buf.item())


def seed_all(seed: int) -> None:
    """Seed python ``random``, numpy's global RNG and torch (CPU and every CUDA device) with ``seed``.

    Examples:
        >>> seed_all(3)
        >>> a = torch.rand(1)
        >>> seed_all(3)
        >>> torch.equal(a, torch.rand(1))
        True
    """
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device, lazily where CUDA is not initialised yet


def _key_words(key: object) -> tuple[int, ...]:
    """Encode one key as 32-bit words, tagged by type so that ``1`` and ``"1"`` never meet."""
    if isinstance(key, bool):
        raise TypeError(f"`keys` of derive_seed must be ints or strings, got the bool {key!r}")
    if isinstance(key, numbers.Integral):
        value = int(key)
        if value < 0:
            raise ValueError(f"`keys` of derive_seed must be non-negative ints, got {value}")
        words = []
        while True:
            words.append(value & 0xFFFFFFFF)
            value >>= 32
            if not value:
                break
        return (0, len(words), *words)
    if isinstance(key, str):
        digest = hashlib.sha256(key.encode("utf-8")).digest()
        return (1, 8, *np.frombuffer(digest, dtype="<u4").tolist())
    raise TypeError(f"`keys` of derive_seed must be ints or strings, got {type(key).__name__}: {key!r}")


def derive_seed(*keys: int | str) -> int:
    """Hash ``keys`` into a seed in ``[0, 2**32 - 1]``: the first word of :class:`numpy.random.SeedSequence`.

    The words are hashed as numpy does, in plain Python, and the state after each prefix of ``keys`` is cached
    (:mod:`~lightning_determinism.seeding._hash`), so a seed whose prefix was seen before costs a few µs.

    Every stream the package derives (workers, samples, tracker streams) comes from here rather than from
    ``base + offset`` arithmetic, where ``(seed=1, rank=1)`` and ``(seed=2, rank=0)`` would coincide.
    The result is the same in every process and python session (no salted ``hash()``).

    Args:
        keys: non-negative ints (any size) and strings, in order; order matters.

    Returns:
        A seed usable by python, numpy and torch.

    Raises:
        TypeError: for a key that is neither an int nor a string.
        ValueError: for a negative int or no keys at all.

    Examples:
        >>> derive_seed(42, "worker", 0) == derive_seed(42, "worker", 0)
        True
        >>> derive_seed(1, 1) != derive_seed(2, 0)
        True
    """
    if not keys:
        raise ValueError("derive_seed needs at least one key, got none")
    normal = tuple(_normal_key(key) for key in keys)
    last = normal[-1]
    if type(last) is int and 0 <= last <= 0xFFFFFFFF:  # a step, a rank, an index: only its value word is new
        return first_word(absorb(_small_int_head(normal[:-1]), (last,)))
    return first_word(absorb(_prefix_state(normal[:-1]), _key_words(last)))


def _normal_key(key: object) -> int | str:
    """``key`` as a plain int or str (the cache must not take ``True`` for ``1``); the checks of :func:`_key_words`."""
    if type(key) is int or type(key) is str:
        return key
    _key_words(key)  # raises for anything that is not a key
    return int(key)  # type: ignore[call-overload]  # an Integral that is not an int (numpy's)


@lru_cache(maxsize=4096)
def _small_int_head(keys: tuple[int | str, ...]) -> State:
    """The state after ``keys`` and the two words (tag 0, one word) that begin every int key below ``2**32``."""
    return absorb(_prefix_state(keys), (0, 1))


@lru_cache(maxsize=4096)
def _prefix_state(keys: tuple[int | str, ...]) -> State:
    """The hash state after ``keys``: the seeds of one prefix (a step's micro-batches, a rank's workers) share it."""
    if not keys:
        return EMPTY
    last = keys[-1]
    if type(last) is int and 0 <= last <= 0xFFFFFFFF:
        return absorb(_small_int_head(keys[:-1]), (last,))
    return absorb(_prefix_state(keys[:-1]), _key_words(last))


class StepSeeds:
    """``derive_seed(*prefix, step, index)``, the hash state after ``(*prefix, step)`` kept between calls.

    The same values as :func:`derive_seed` (tested against numpy), without its per-call work: a new step costs the
    absorption of the step's key words, each index one word more. :meth:`prepare` absorbs a step's words ahead of
    time (the invariant mode does it while the previous step's gradients are in flight).

    Args:
        prefix: the leading keys, as for :func:`derive_seed`.

    Examples:
        >>> seeds = StepSeeds(42, "micro-batch")
        >>> seeds(7, 3) == derive_seed(42, "micro-batch", 7, 3) and seeds(8, 0) == derive_seed(42, "micro-batch", 8, 0)
        True
    """

    __slots__ = ("_head", "_next", "_prefix", "_state", "_step")

    def __init__(self, *prefix: int | str) -> None:
        self._prefix = tuple(_normal_key(key) for key in prefix)
        self._head = _small_int_head(self._prefix)  # the prefix, then every small int key's (tag, length) words
        self._step = -1
        self._state = self._head
        self._next: tuple[int, State] | None = None

    def _step_state(self, step: int) -> State:
        return absorb(self._head, (step, 0, 1))  # the step's word, then the index's (tag, length) words

    def prepare(self, step: int) -> None:
        """Absorb ``step``'s key words now rather than at its first call."""
        if type(step) is int and 0 <= step <= _WORD and step != self._step:
            self._next = (step, self._step_state(step))

    def __call__(self, step: int, index: int) -> int:
        """``derive_seed(*prefix, step, index)``."""
        if not (type(step) is int and type(index) is int and 0 <= step <= _WORD and 0 <= index <= _WORD):
            return derive_seed(*self._prefix, step, index)  # large or unusual keys: the general path
        if step != self._step:
            prepared = self._next
            self._state = prepared[1] if prepared is not None and prepared[0] == step else self._step_state(step)
            self._step, self._next = step, None
        return first_word(absorb(self._state, (index,)))


_WORD = 0xFFFFFFFF


def resolve_base_seed(seed: object, rank: int, world_size: int, use_pl_global_seed: bool = False) -> int:
    """Agree on one base seed on every rank.

    An explicit ``seed`` is range-checked. With ``seed=None`` rank 0 picks one (``PL_GLOBAL_SEED`` first when
    ``use_pl_global_seed``, else OS entropy) and broadcasts it, so ranks agree even if their environments differ.

    Examples:
        >>> resolve_base_seed(11, rank=0, world_size=1)
        11
    """
    if seed is not None:
        return check_seed(seed, world_size)
    candidate = -1
    if rank == 0:
        env_seed = os.environ.get(_PL_GLOBAL_SEED) if use_pl_global_seed else None
        if env_seed is not None:
            try:
                candidate = check_seed(int(env_seed), world_size, name=_PL_GLOBAL_SEED)
            except ValueError as err:
                raise ValueError(f"`{_PL_GLOBAL_SEED}` must hold an int seed, got {env_seed!r}: {err}") from None
        else:
            candidate = draw_seed(world_size)
    if world_size > 1:
        candidate = broadcast_seed(candidate, src=0)
    return candidate


def set_seed(seed: int | None = None, debug_mode: DebugMode = None) -> int:
    """Seed this process with ``seed + rank`` and optionally make the backends deterministic.

    Same contract as torchtune's ``set_seed``, so it works under plain ``torch.distributed`` and ``torchrun``:
    rank and world size come from the default process group when it is initialised (else 0 and 1).

    Args:
        seed: the global seed, in ``[0, 2**32 - 1 - (world_size - 1)]``. ``None`` draws one on rank 0 from OS
            entropy and broadcasts it to every rank.
        debug_mode: ``None`` touches no backend flag; otherwise passed to :func:`configure_determinism`
            (``"default"``/0, ``"warn"``/1, ``"error"``/2).

    Returns:
        The global seed (the same on every rank).

    Raises:
        TypeError: if ``seed`` is not an integer.
        ValueError: if ``seed`` is out of range or ``debug_mode`` is not an accepted value.

    Examples:
        >>> set_seed(42)
        42
        >>> a = torch.rand(2)
        >>> _ = set_seed(42)
        >>> torch.equal(a, torch.rand(2))
        True
    """
    rank, world_size = _rank_and_world_size()
    if seed is not None:
        seed = check_seed(seed, world_size)
    if debug_mode is not None:
        configure_determinism(debug_mode)  # validates before any RNG is touched
    base = resolve_base_seed(seed, rank, world_size)
    seed_all(base + rank)
    _record_seeds(base, base + rank)
    return base


__all__: Sequence[str] = [
    "MAX_SEED",
    "broadcast_seed",
    "check_seed",
    "current_seeds",
    "derive_seed",
    "draw_seed",
    "resolve_base_seed",
    "seed_all",
    "set_seed",
]
