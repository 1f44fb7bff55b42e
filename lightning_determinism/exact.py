"""Order-invariant accumulation: the same bits whatever the order of the terms, the batch split or the world size.

A float sum depends on the order of its terms; over processes it depends on how many there are. Here every term is
turned into a fixed-point number with 64 fractional bits, held as three int64 *limbs*
``(units, high, low)`` with ``value = units + high * 2**-32 + low * 2**-64`` and ``high, low`` in ``[0, 2**32)``.
Integer addition is associative, so limbs can be summed in any order, in any grouping and across processes (a plain
``all_reduce(SUM)``), and always give the same bits. A float64 term in ``[2**-12, 2**42)`` converts without
rounding at all (its last bit lies at or above ``2**-64``); smaller terms are rounded to the nearest ``2**-64``, once,
in a way that does not depend on anything but the term.

Limits, checked (``ValueError`` past them):

- a term: ``|x| < 2**42`` (about 4.4e12) and finite (callers count NaN and infinities on their own);
- a total held by one process: ``|sum| < 2**55`` (about 3.6e16), so that the totals of up to 256 processes still
  add up within int64.

This module is a leaf: it knows torch, nothing of Lightning or torchmetrics.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch
from torch import Tensor

TERM_LIMIT = 2.0**42
"""Largest magnitude (exclusive) of one term."""

TOTAL_LIMIT = 2**55
"""Largest magnitude (exclusive) of the total one process may hold."""

_WORD = 2**32
_PIECE = 2**20  # terms summed at once: 2**20 * 2**42 < 2**63 for the units, 2**20 * 2**32 for the fractions


def zero_limbs(device: torch.device | str | None = None) -> Tensor:
    """The exact zero: an int64 tensor ``[units, high, low]``.

    Examples:
        >>> zero_limbs()
        tensor([0, 0, 0])
    """
    return torch.zeros(3, dtype=torch.int64, device=device)


def normalize(limbs: Tensor) -> Tensor:
    """Carry ``low`` into ``high`` and ``high`` into ``units`` so that both fractions lie in ``[0, 2**32)``.

    Works on any int64 tensor whose last dimension holds the three limbs (a sum of normalized limbs, e.g. after an
    ``all_reduce``, is a valid input).

    Examples:
        >>> normalize(torch.tensor([0, 2**32 + 5, -1]))
        tensor([         1,          4, 4294967295])
    """
    units, high, low = limbs.unbind(-1)
    high = high + (low >> 32)  # arithmetic shift: floor division by 2**32, also for negative values
    low = low & (_WORD - 1)
    units = units + (high >> 32)
    high = high & (_WORD - 1)
    return torch.stack((units, high, low), dim=-1)


def exact_sum(values: Tensor) -> Tensor:
    """Sum finite values exactly (to ``2**-64`` per term) into normalized limbs ``[units, high, low]``.

    Every step is exact or a rounding of one term on its own (``floor`` of the magnitude, subtraction of the floor,
    scaling by powers of two, one round-to-nearest-even at ``2**-64``), so the result does not depend on the order
    of ``values``, on how they are split into calls, on threads or on the device.

    Args:
        values: any shape, any float dtype (converted to float64 exactly), every element finite with ``|x| < 2**42``.

    Returns:
        int64 tensor of shape ``[3]`` on the device of ``values``.

    Raises:
        ValueError: for a non-finite value or one of magnitude ``2**42`` or more.

    Examples:
        >>> a = torch.tensor([0.1, 1e10, -1e10, 2.0**-60], dtype=torch.float64)
        >>> torch.equal(exact_sum(a), exact_sum(a.flip(0)))
        True
        >>> 0.1 + 1e10 - 1e10, limbs_to_float(exact_sum(a))  # float64 loses 0.1 against 1e10; the limbs do not
        (0.10000038146972656, 0.1)
    """
    x = values.detach().reshape(-1).to(torch.float64)
    total = zero_limbs(x.device)
    if x.numel() == 0:
        return total
    bad = ~torch.isfinite(x) | (x.abs() >= TERM_LIMIT)
    if bool(bad.any()):
        first = float(x[bad][0])
        raise ValueError(
            f"exact accumulation takes finite terms of magnitude below 2**42 ({TERM_LIMIT:.4g}), got {first!r}"
        )
    for start in range(0, x.numel(), _PIECE):
        part = x[start : start + _PIECE]
        # Split |x|, not x: for x >= 0, x - floor(x) is exact, while 1 - 0.003 (the fraction of -0.003) would round.
        magnitude = part.abs()
        sign = torch.where(part < 0, -1, 1).to(torch.int64)
        units = torch.floor(magnitude)
        rest = (magnitude - units) * _WORD  # exact: scaling by a power of two
        high = torch.floor(rest)
        low = torch.round((rest - high) * _WORD)  # the only rounding: at 2**-64, half to even, symmetric in sign
        limbs = torch.stack((units, high, low), dim=-1).to(torch.int64) * sign[:, None]
        total = normalize(total + limbs.sum(dim=0))
    return total


def fixed_point(x: float) -> int:
    """One term as :func:`exact_sum` holds it, in Python: the integer ``round(x * 2**64)``, half to even.

    For a few terms, where torch's per-call cost dominates (a step's loss); :func:`limbs_of` turns a sum of these into
    the limbs :func:`exact_sum` gives for the same terms.

    Raises:
        ValueError: for a non-finite value or one of magnitude ``2**42`` or more.

    Examples:
        >>> terms = torch.tensor([0.1, -2.5], dtype=torch.float64)
        >>> torch.equal(limbs_of(fixed_point(0.1) + fixed_point(-2.5)), exact_sum(terms))
        True
    """
    if not (math.isfinite(x) and abs(x) < TERM_LIMIT):
        raise ValueError(
            f"exact accumulation takes finite terms of magnitude below 2**42 ({TERM_LIMIT:.4g}), got {x!r}"
        )
    n = round(Fraction(abs(x)) * _WORD * _WORD)  # Fraction's round: half to even, as torch.round in exact_sum
    return -n if x < 0 else n


def limbs_of(total: int) -> Tensor:
    """The normalized limbs ``[units, high, low]`` of ``total * 2**-64``: the inverse of ``limbs_to_fraction * 2**64``.

    ``total`` is an integer, e.g. a sum of :func:`fixed_point` terms.

    Examples:
        >>> limbs_of(-1)  # -2**-64: units -1, fractions 2**32 - 1 each
        tensor([        -1, 4294967295, 4294967295])
    """
    return torch.tensor(int_limbs(total), dtype=torch.int64)


def int_limbs(total: int) -> list[int]:
    """:func:`limbs_of` as Python integers ``[units, high, low]`` (to travel in a row of int64 words).

    Examples:
        >>> int_limbs(3 << 63), fixed_total(*int_limbs(3 << 63)) == 3 << 63
        ([1, 2147483648, 0], True)
    """
    return [total >> 64, (total >> 32) & (_WORD - 1), total & (_WORD - 1)]


def fixed_total(units: int, high: int, low: int) -> int:
    """The value of (possibly unnormalized) limbs in units of ``2**-64``: the inverse of :func:`int_limbs`."""
    return units * _WORD * _WORD + high * _WORD + low


def fixed_mean(total: int, count: int) -> float:
    """``total * 2**-64 / count`` correctly rounded to float64 (NaN for ``count == 0``).

    Examples:
        >>> fixed_mean(fixed_point(1.0) + fixed_point(2.0), 2)
        1.5
    """
    return float("nan") if count == 0 else total / (count * _WORD * _WORD)  # int / int: correctly rounded


def check_total(limbs: Tensor, what: str = "the exact sum") -> None:
    """Raise if one process's normalized total has left ``(-2**55, 2**55)`` (int64 headroom for the sync).

    Raises:
        ValueError: naming ``what``, the limit and the total.

    Examples:
        >>> check_total(torch.tensor([2**55, 0, 0]), "the NLL sum")
        Traceback (most recent call last):
        ...
        ValueError: the NLL sum has reached 3.603e+16, past the exact range of +-2**55 (3.603e+16) one process may hold
    """
    units = int(limbs[0])
    if not -TOTAL_LIMIT < units < TOTAL_LIMIT:
        raise ValueError(
            f"{what} has reached {units:.4g}, past the exact range of +-2**55 ({float(TOTAL_LIMIT):.4g}) one process"
            " may hold"
        )


def limbs_to_fraction(limbs: Tensor) -> Fraction:
    """The exact rational value of (possibly unnormalized) limbs.

    Examples:
        >>> limbs_to_fraction(torch.tensor([1, 2**31, 0]))
        Fraction(3, 2)
    """
    return Fraction(fixed_total(*(int(v) for v in limbs.tolist())), _WORD * _WORD)


def limbs_to_float(limbs: Tensor) -> float:
    """The value of the limbs, correctly rounded to float64.

    Examples:
        >>> limbs_to_float(exact_sum(torch.tensor([0.25, 0.5])))
        0.75
    """
    return float(limbs_to_fraction(limbs))


def exact_mean(limbs: Tensor, count: int | Tensor) -> float:
    """``sum / count`` correctly rounded to float64 (NaN for ``count == 0``).

    The division is done on the exact rational value, so every process that holds the same limbs and count gets the
    same bits.

    Examples:
        >>> exact_mean(exact_sum(torch.tensor([1.0, 2.0, 4.0])), 3)
        2.3333333333333335
    """
    return fixed_mean(fixed_total(*(int(v) for v in limbs.tolist())), int(count))


__all__ = [
    "TERM_LIMIT",
    "TOTAL_LIMIT",
    "check_total",
    "exact_mean",
    "exact_sum",
    "fixed_mean",
    "fixed_point",
    "fixed_total",
    "int_limbs",
    "limbs_of",
    "limbs_to_float",
    "limbs_to_fraction",
    "normalize",
    "zero_limbs",
]
