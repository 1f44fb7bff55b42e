"""The perplexity's arithmetic, written once so that every path computes the same bits on every CPU.

Three paths compute a row's statistics -- the C kernel (:mod:`._native`), Inductor's kernel compiled from
:func:`row_sums`, and :func:`row_sums` run eagerly where no compiler exists -- and they must agree bitwise, on any
x86-64 or ARM CPU. Every step here is therefore one of:

- an IEEE operation that rounds once and the same way everywhere: ``+``, ``-``, ``*``, ``/`` on float32 or float64,
  round-to-nearest-even (``rint``), conversions; never a fused multiply-add (whether a compiler contracts ``a * b + c``
  into one depends on the compiler, its flags and the CPU), never a library ``exp`` or ``log`` (their last bit
  differs between libm, SLEEF, numpy and Inductor's vector code);
- integer arithmetic, which is exact: each exponential is rounded once to a fixed-point integer (units of
  ``2**-52``) and a row's terms are summed as integers, so the order of the sum -- vector width, lanes, threads --
  cannot change it.

Per row of logits ``x`` (float32, or half types upcast exactly) of at least 4,096 classes -- float64 logits and
smaller vocabularies take the same steps in float64, where they cost little (:func:`wide`):

1. ``m = max(x)``; ``d = max(x - m, -87)`` in float32.
2. ``exp(d) = 2**k * exp(r)``: ``k = rint(d / ln2)``, ``r = d - k ln2`` with ln2 split in two so that the first
   product and subtraction are exact and what the second subtraction rounds away is kept (``r = rh + rl``); then a
   degree-8 polynomial (coefficients fitted for ``|r| <= ln2 / 2``) in float32, each product and sum rounded on its
   own. A rounded ``r`` alone would bias every exponential with the same ``k`` alike (logits sit on a float32 grid).
3. ``q = trunc(exp(d) * 2**52 + 0.5)``, an integer ``<= 2**52``; the row's ``S = sum(q)`` exactly (int64
   pieces).
4. ``log(S * 2**-52)`` in float64 by :func:`log_fixed` (a reduction to ``[sqrt(1/2), sqrt(2))`` and an odd series).

The perplexity's last step, ``exp(mean NLL)``, is :func:`exp_float` (float64, Python's own IEEE arithmetic).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

FLOOR = -87.0
"""``exp(d)`` for ``d`` below this is subnormal (slow on CPUs) and under ``2**-125`` of a row's sum: clamped."""

SCALE_BITS = 52
"""Each exponential is held as an integer number of ``2**-52``."""

INV_LN2_F = float.fromhex("0x1.715476p+0")  # 1/ln2 rounded to float32
LN2_HI = float.fromhex("0x1.62e4p-1")  # ln2 to 15 significant bits: k * LN2_HI and d - k * LN2_HI are exact
LN2_LO = float.fromhex("0x1.7f7d1cp-20")  # ln2 - LN2_HI rounded to float32 (off by 5.5e-14)
POLY = (  # (exp(r) - 1 - r) / r**2 for |r| <= ln2 / 2, highest degree first, float32
    2.470828258083202e-05,
    0.00019908939430024475,
    0.001388919772580266,
    0.008333281613886356,
    0.0416666641831398,
    0.1666666716337204,
    0.5,
)
WIDE_BELOW = 4096
"""Below this many classes, float32 and half logits take float64 exponentials too (see :func:`wide`)."""

NAN_MARK = -1
"""``sum_hi`` of a row holding NaN or whose max is infinite: its NLL is NaN."""

_F32 = torch.float32
_LOW32 = (1 << 32) - 1


def _exp_fixed(d: Tensor) -> Tensor:
    """``exp(d) * 2**52`` rounded to an int64 for float32 ``d`` in ``[FLOOR, 0]`` (the module's steps 2 and 3).

    Rounded, not truncated: a row of many tiny terms (a peaked distribution) would otherwise lose half a unit each.
    """
    # In place where a value is not read again (3x faster on the eager path; the same operations either way).
    k = torch.mul(d, INV_LN2_F).round_()
    r_hi = torch.sub(d, torch.mul(k, LN2_HI))  # exact: a multiple of 2**-25 below 1/2 in magnitude
    s = torch.mul(k, LN2_LO)
    rh = torch.sub(r_hi, s)
    rl = r_hi.sub_(rh).sub_(s)  # what rounding rh dropped (exact unless |r_hi| < |s|, where rh is tiny anyway)
    p = torch.full_like(rh, POLY[0])
    for c in POLY[1:]:
        p.mul_(rh).add_(c)
    e = p.mul_(torch.mul(rh, rh)).add_(rl).add_(rh).add_(1.0)  # ((p * rh**2 + rl) + rh) + 1: in [0.70, 1.42]
    # e * 2**(k + 52): the exponent field moved by k + 52; normal for d >= FLOOR, at most 2**52 (d = 0 gives 1.0).
    shift = k.to(torch.int32).add_(SCALE_BITS).bitwise_left_shift_(23)
    scaled = e.view(torch.int32).add_(shift).view(_F32)
    return scaled.add_(0.5).to(torch.int64)  # rounded (the C kernel's cheapest rounding that vectorises)


_EXP64_TAYLOR = tuple(1.0 / math.factorial(n) for n in range(12, 1, -1))  # 1/12!, ..., 1/2!
LN2_HI_D = 6.93147180369123816490e-01  # ln2 to 32 significant bits: k * LN2_HI_D is exact for |k| < 2**21
LN2_LO_D = 1.90821492927058770002e-10  # ln2 - LN2_HI_D
INV_LN2_D = 1.4426950408889634


def _exp_fixed64(d: Tensor) -> Tensor:
    """``exp(d) * 2**52`` rounded to an int64 for float64 ``d`` in ``[FLOOR, 0]``: float64 throughout (degree 12)."""
    k = torch.mul(d, INV_LN2_D).round_()
    r = torch.sub(d, torch.mul(k, LN2_HI_D)).sub_(torch.mul(k, LN2_LO_D))
    p = torch.full_like(r, _EXP64_TAYLOR[0])
    for c in _EXP64_TAYLOR[1:]:
        p.mul_(r).add_(c)
    e = p.mul_(torch.mul(r, r)).add_(r).add_(1.0)  # (p * r**2 + r) + 1: in [0.70, 1.42]
    shift = k.to(torch.int64).add_(SCALE_BITS).bitwise_left_shift_(52)
    scaled = e.view(torch.int64).add_(shift).view(torch.float64)
    return scaled.add_(0.5).to(torch.int64)


def wide(dtype: torch.dtype, vocab: int) -> bool:
    """Whether rows of ``vocab`` logits of ``dtype`` take float64 exponentials (else float32 ones, as the C kernel).

    float64 logits always do, and vocabularies below :data:`WIDE_BELOW` (where their cost is small); the choice
    depends on nothing else, so every path takes the same one.
    """
    return dtype == torch.float64 or vocab < WIDE_BELOW


def row_sums(logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Row max, and the row's ``S`` as ``(S >> 32, S & 0xffffffff)`` int64, for logits ``[N, V]`` of any float dtype.

    ``sum_hi`` is :data:`NAN_MARK` for a row holding NaN or whose max is infinite. The arithmetic is this module's,
    bit for bit what the C kernel computes for float32 exponentials; eager or compiled by Inductor (which contracts
    no multiply-add unless told to), the same integers.
    """
    if wide(logits.dtype, logits.shape[-1]):
        return row_sums_wide(logits)
    return row_sums_narrow(logits)


def row_sums_narrow(logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`row_sums` with float32 exponentials (the C kernel's arithmetic)."""
    x = logits.to(_F32)
    top = x.amax(dim=-1, keepdim=True)
    return _sums(top, _exp_fixed(torch.sub(x, top).clamp_min_(FLOOR)))


def row_sums_wide(logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`row_sums` with float64 exponentials."""
    x = logits.to(torch.float64)
    top = x.amax(dim=-1, keepdim=True)
    return _sums(top, _exp_fixed64(torch.sub(x, top).clamp_min_(FLOOR)))


def _sums(top: Tensor, q: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    high = (q >> 32).sum(dim=-1)  # <= V * 2**20
    low = (q & _LOW32).sum(dim=-1)  # <= V * 2**32: no overflow below 2**31 classes
    sum_hi = high + (low >> 32)
    sum_lo = low & _LOW32
    top = top.squeeze(-1)
    # amax propagates NaN: a row holding one has a NaN max (no second pass over the row to find it).
    sum_hi = torch.where(torch.isfinite(top), sum_hi, torch.full_like(sum_hi, NAN_MARK))
    return top, sum_hi, sum_lo


_SQRT2 = 1.4142135623730951
_ATANH = tuple(1.0 / n for n in range(21, 1, -2))  # 1/21, 1/19, ..., 1/3: 2*atanh(u) = 2u(1 + u^2/3 + ...)
_EXP_BITS = 52
_MANTISSA = (1 << 52) - 1
_ONE_BITS = 1023 << 52


def log_fixed(sum_hi: Tensor, sum_lo: Tensor) -> Tensor:
    """``log(S * 2**-52)`` in float64 from ``S``'s two int64 pieces (NaN where ``sum_hi`` is :data:`NAN_MARK`).

    ``S * 2**-52`` is at least 1 (the row's max contributes exactly ``2**52``) and is rounded once to float64
    (``hi * 2**32 + lo``). ``log(s) = e ln2 + log(m)`` with ``m`` in ``[sqrt(1/2), sqrt(2))``, ``log(m) = 2 atanh(u)``
    for ``u = (m - 1) / (m + 1)``, ``|u| <= 0.172``: the series to ``u**21`` is within ``2e-17``. Error about 2 ulp.
    """
    s = (sum_hi.to(torch.float64) * 2.0**32 + sum_lo.to(torch.float64)) * 2.0**-SCALE_BITS
    bits = s.view(torch.int64)
    exponent = (bits >> _EXP_BITS) - 1023
    m = ((bits & _MANTISSA) | _ONE_BITS).view(torch.float64)  # in [1, 2)
    big = m > _SQRT2
    m = torch.where(big, m * 0.5, m)
    exponent = (exponent + big.to(torch.int64)).to(torch.float64)
    f = m - 1.0  # exact
    u = f / (f + 2.0)
    z = u * u
    series = torch.full_like(z, _ATANH[0])
    for c in _ATANH[1:]:
        series = series * z + c
    log_m = (u + u) * (series * z + 1.0)
    out = exponent * LN2_HI_D + (exponent * LN2_LO_D + log_m)
    return torch.where(sum_hi == NAN_MARK, torch.full_like(out, math.nan), out)


_EXP_TAYLOR = tuple(1.0 / math.factorial(n) for n in range(14, 0, -1))  # 1/14!, ..., 1/1!
_EXP_MAX = 709.782712893384  # exp above this overflows float64
_EXP_MIN = -745.1332191019412  # and below this is 0


def exp_float(x: float) -> float:
    """``exp(x)`` from IEEE float64 operations alone: the same bits on every machine (about 1 ulp from exact).

    Python floats are IEEE doubles whose ``+``, ``-``, ``*`` round once each; ``math.exp`` calls the C library, whose
    last bit depends on its version and on the CPU (an FMA path is chosen at run time).

    Examples:
        >>> exp_float(0.0), exp_float(math.inf), exp_float(-math.inf), math.isnan(exp_float(math.nan))
        (1.0, inf, 0.0, True)
        >>> abs(exp_float(2.5) - math.exp(2.5)) <= 2 * math.ulp(math.exp(2.5))
        True
    """
    if math.isnan(x):
        return x
    if x > _EXP_MAX:
        return math.inf
    if x < _EXP_MIN:
        return 0.0
    k = round(x * INV_LN2_D)  # half to even
    r = (x - k * LN2_HI_D) - k * LN2_LO_D  # |k| < 1100: k * LN2_HI_D is exact
    p = _EXP_TAYLOR[0]
    for c in _EXP_TAYLOR[1:]:
        p = p * r + c
    p = p * r + 1.0
    try:
        return math.ldexp(p, k)  # exact where the result is normal
    except OverflowError:
        return math.inf


__all__ = [
    "FLOOR",
    "NAN_MARK",
    "SCALE_BITS",
    "WIDE_BELOW",
    "exp_float",
    "log_fixed",
    "row_sums",
    "row_sums_narrow",
    "row_sums_wide",
    "wide",
]
