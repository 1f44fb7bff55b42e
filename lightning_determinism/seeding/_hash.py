"""numpy's ``SeedSequence`` hash, word by word in plain Python, with the state after each key prefix cached.

:func:`~lightning_determinism.derive_seed` has always returned
``SeedSequence(words).generate_state(1, dtype=np.uint32)[0]``. Building a ``SeedSequence`` costs ~40 µs, which
dominated the invariant mode's per-micro-batch reseed. The hash itself is a few dozen 32-bit multiply/xor-shift
steps over the entropy words, absorbed one at a time, so the state after a prefix of the words can be kept: the
micro-batch seeds ``(base, "micro-batch", step, j)`` of one step then share everything but the last key. Every value
equals numpy's (``tests/seeding/test_seeding.py`` pins a table and compares against numpy over random keys); the
caching of prefixes lives with :func:`~lightning_determinism.derive_seed`.

The constants and the order of operations are those of numpy's ``bit_generator.pyx`` (pool size 4).
"""

from __future__ import annotations

_MASK = 0xFFFFFFFF
_POOL = 4
_INIT_A = 0x43B0D7E5
_MULT_A = 0x931E8875
_INIT_B = 0x8B51F9DD
_MULT_B = 0x58F38DED
_MIX_L = 0xCA01F9DD
_MIX_R = 0x4973F715
_SHIFT = 16

State = tuple[tuple[int, ...], int, int]  # (pool words, hash constant, words absorbed)
EMPTY: State = ((0, 0, 0, 0), _INIT_A, 0)


def _spread(pool: list[int], h: int) -> int:
    """Mix every pool word into every other one (numpy does this once the pool is full)."""
    for src in range(_POOL):
        for dst in range(_POOL):
            if src != dst:
                value = pool[src] ^ h
                h = (h * _MULT_A) & _MASK
                value = (value * h) & _MASK
                value ^= value >> _SHIFT
                mixed = (_MIX_L * pool[dst] - _MIX_R * value) & _MASK
                pool[dst] = mixed ^ (mixed >> _SHIFT)
    return h


def absorb(state: State, words: tuple[int, ...]) -> State:
    """The hash state after ``words`` (32-bit values) more entropy words.

    Examples:
        >>> absorb(absorb(EMPTY, (1, 2)), (3,)) == absorb(EMPTY, (1, 2, 3))
        True
    """
    pool, h, n = list(state[0]), state[1], state[2]
    for word in words:
        if n < _POOL:
            value = word ^ h
            h = (h * _MULT_A) & _MASK
            value = (value * h) & _MASK
            pool[n] = value ^ (value >> _SHIFT)
            n += 1
            if n == _POOL:
                h = _spread(pool, h)
        else:  # the word into each of the 4 pool words, unrolled (the hot path of a cached prefix)
            p0, p1, p2, p3 = pool
            v = ((word ^ h) * (h := (h * _MULT_A) & _MASK)) & _MASK  # the old h, then the new one
            v ^= v >> _SHIFT
            m = (_MIX_L * p0 - _MIX_R * v) & _MASK
            p0 = m ^ (m >> _SHIFT)
            v = ((word ^ h) * (h := (h * _MULT_A) & _MASK)) & _MASK
            v ^= v >> _SHIFT
            m = (_MIX_L * p1 - _MIX_R * v) & _MASK
            p1 = m ^ (m >> _SHIFT)
            v = ((word ^ h) * (h := (h * _MULT_A) & _MASK)) & _MASK
            v ^= v >> _SHIFT
            m = (_MIX_L * p2 - _MIX_R * v) & _MASK
            p2 = m ^ (m >> _SHIFT)
            v = ((word ^ h) * (h := (h * _MULT_A) & _MASK)) & _MASK
            v ^= v >> _SHIFT
            m = (_MIX_L * p3 - _MIX_R * v) & _MASK
            p3 = m ^ (m >> _SHIFT)
            pool = [p0, p1, p2, p3]
            n += 1
    return tuple(pool), h, n


def first_word(state: State) -> int:
    """``generate_state(1, dtype=np.uint32)[0]`` of a sequence whose entropy words were absorbed into ``state``.

    Examples:
        >>> import numpy as np
        >>> first_word(absorb(EMPTY, (7, 8, 9))) == int(np.random.SeedSequence([7, 8, 9]).generate_state(1)[0])
        True
    """
    pool, h, n = state
    if n < _POOL:  # fewer words than the pool: numpy runs the hash on zeros to fill it, then spreads
        filled = list(pool)
        for i in range(n, _POOL):
            value = h
            h = (h * _MULT_A) & _MASK
            value = (value * h) & _MASK
            filled[i] = value ^ (value >> _SHIFT)
        _spread(filled, h)
        pool = tuple(filled)
    value = pool[0] ^ _INIT_B
    value = (value * ((_INIT_B * _MULT_B) & _MASK)) & _MASK
    return value ^ (value >> _SHIFT)


__all__ = ["EMPTY", "State", "absorb", "first_word"]
