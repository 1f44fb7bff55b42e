"""Exact fixed-point accumulation against independent references: fractions.Fraction and math.fsum."""

import math
import random
from fractions import Fraction

import pytest
import torch

from lightning_determinism.exact import (
    TERM_LIMIT,
    check_total,
    exact_mean,
    exact_sum,
    limbs_to_float,
    limbs_to_fraction,
    normalize,
)


def _awkward_values(n=5000, seed=0):
    """Magnitudes from 1e-3 to 1e11, both signs, and large values that cancel: hard for any float sum."""
    rng = random.Random(seed)
    values = [rng.choice([-1, 1]) * 10 ** rng.uniform(-3, 11) for _ in range(n)]
    values += [1e11, -1e11, 3.0, 2.0**-12]
    return torch.tensor(values, dtype=torch.float64)


def test_sum_is_the_exact_rational_sum():
    values = _awkward_values()
    exact = sum(Fraction(v) for v in values.tolist())  # every term >= 2**-12 in magnitude converts exactly
    assert limbs_to_fraction(exact_sum(values)) == exact
    assert limbs_to_float(exact_sum(values)) == math.fsum(values.tolist())  # fsum: correctly rounded, independent


def test_same_bits_for_any_order_and_split():
    values = _awkward_values(seed=1)
    reference = exact_sum(values)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        shuffled = values[torch.randperm(len(values), generator=gen)]
        cuts = sorted(torch.randint(len(values), (7,), generator=gen).tolist())
        parts = [shuffled[a:b] for a, b in zip([0, *cuts], [*cuts, len(values)], strict=True)]
        total = normalize(sum((exact_sum(p) for p in parts), start=torch.zeros(3, dtype=torch.int64)))
        assert torch.equal(total, reference)
    # A float64 sum, by contrast, depends on the order (so the test above could fail).
    float_sums = {sum(values[torch.randperm(len(values), generator=gen)].tolist()) for _ in range(5)}
    assert len(float_sums) > 1


def test_tiny_terms_round_once_to_two_to_the_minus_64():
    values = torch.tensor([2.0**-70, 3 * 2.0**-66, 1.0], dtype=torch.float64)
    # 2**-70 is below half a unit of 2**-64 and vanishes; 3 * 2**-66 = 0.75 units rounds to one unit.
    assert limbs_to_fraction(exact_sum(values)) == 1 + Fraction(1, 2**64)


def test_negative_values_and_normalization():
    values = torch.tensor([-0.75, -1e9 - 0.5, 2.0], dtype=torch.float64)
    limbs = exact_sum(values)
    assert 0 <= int(limbs[1]) < 2**32 and 0 <= int(limbs[2]) < 2**32
    assert limbs_to_fraction(limbs) == sum(Fraction(v) for v in values.tolist())
    unnormalized = torch.tensor([5, 3 * 2**32 + 7, -(2**33)], dtype=torch.int64)
    assert limbs_to_fraction(normalize(unnormalized)) == limbs_to_fraction(unnormalized)


def test_mean_is_correctly_rounded():
    values = _awkward_values(n=999, seed=2)
    exact = sum(Fraction(v) for v in values.tolist()) / len(values)
    assert exact_mean(exact_sum(values), len(values)) == float(exact)
    assert math.isnan(exact_mean(exact_sum(values), 0))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), TERM_LIMIT, -TERM_LIMIT * 2])
def test_terms_outside_the_range_are_refused(bad):
    with pytest.raises(ValueError, match=r"finite terms of magnitude below 2\*\*42"):
        exact_sum(torch.tensor([1.0, bad], dtype=torch.float64))


def test_just_inside_the_range_is_exact():
    below = math.nextafter(TERM_LIMIT, 0)
    assert limbs_to_float(exact_sum(torch.tensor([below, -below, 0.5], dtype=torch.float64))) == 0.5


def test_total_past_the_process_limit_is_refused():
    check_total(torch.tensor([2**55 - 1, 0, 0]))
    with pytest.raises(ValueError, match=r"past the exact range of \+-2\*\*55"):
        check_total(torch.tensor([-(2**55), 0, 0]), "the total")


def test_float32_and_half_inputs_convert_exactly():
    values = torch.tensor([0.1, 1.5, -2.25], dtype=torch.float32)
    expected = sum(Fraction(v) for v in values.double().tolist())
    assert limbs_to_fraction(exact_sum(values)) == expected
    halves = values.bfloat16()
    assert limbs_to_fraction(exact_sum(halves)) == sum(Fraction(v) for v in halves.double().tolist())


def test_the_python_fixed_point_of_a_term_is_exact_sums_bit_for_bit():
    # The recorder's per-step loss takes the Python path; a sum of any terms must give exact_sum's limbs, rounding
    # cases included: terms below 2**-12 round at 2**-64, halfway ones (x * 2**64 = k + 1/2) to even.
    from lightning_determinism.exact import fixed_point, limbs_of

    generator = torch.Generator().manual_seed(3)
    scales = 2.0 ** torch.randint(-80, 40, (400,), generator=generator).double()
    terms = torch.randn(400, generator=generator, dtype=torch.float64) * scales
    halfway = torch.tensor([k * 2.0**-65 for k in (1, 3, 5, -1, -3, 7)], dtype=torch.float64)
    terms = torch.cat((terms, halfway, torch.tensor([0.0, -0.0, 2.0**42 - 1, -(2.0**-1074)], dtype=torch.float64)))
    for chunk in (terms[:1], terms[400:], terms):
        assert torch.equal(limbs_of(sum(fixed_point(float(x)) for x in chunk)), exact_sum(chunk))
    with pytest.raises(ValueError, match="below 2\\*\\*42"):
        fixed_point(2.0**42)
    with pytest.raises(ValueError, match="got nan"):
        fixed_point(float("nan"))
