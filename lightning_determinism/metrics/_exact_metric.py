"""The base of the package's metrics: exact int64 states, locked against dtype conversions.

Extra update methods (``update_from_loss``) survive pickling, ``clone()`` and ``deepcopy`` like torchmetrics' own
``update``: each copy gets a wrapper of its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

from lightning_determinism._compat.access import metric_defaults
from lightning_determinism._compat.checks import require
from lightning_determinism._compat.features import METRICS
from lightning_determinism.exact import check_total, exact_mean, exact_sum, normalize, zero_limbs


class ExactMetric(Metric):
    """A torchmetrics ``Metric`` whose sum is held as exact fixed-point limbs (see :mod:`lightning_determinism.exact`).

    States, all ``dist_reduce_fx="sum"`` and locked to int64 (``half()``, ``set_dtype()``, ``.to(dtype)`` and
    Lightning's ``bf16-true`` precision leave them alone):

    - ``<limbs>``: the exact sum as ``[units, high, low]``;
    - ``count``: the exact count (or integer weight);
    - ``nonfinite``: how many NaN, ``+inf`` and ``-inf`` terms were met, kept apart from the exact sum.

    Subclasses name the limbs state in ``_LIMBS`` and list in ``_EXTRA_UPDATES`` any method that updates the states
    besides ``update``; those get torchmetrics' bookkeeping (cache invalidation, update count, ``compute_on_cpu``) and
    are rebuilt for each copy, never shared with the original.
    """

    _LIMBS = "limbs"
    _EXTRA_UPDATES: tuple[str, ...] = ()

    count: Tensor
    nonfinite: Tensor

    def __init__(self, **kwargs: Any) -> None:
        require(METRICS)
        super().__init__(**kwargs)
        self.add_state(self._LIMBS, default=zero_limbs(), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")
        self.add_state("nonfinite", default=torch.zeros(3, dtype=torch.int64), dist_reduce_fx="sum")
        self._wrap_extra_updates()

    def _wrap_extra_updates(self) -> None:
        for name in self._EXTRA_UPDATES:
            # A bound wrapper in the instance dict: dropped by __getstate__, rebuilt by __setstate__ for each copy.
            setattr(self, name, self._wrap_update(getattr(type(self), name).__get__(self)))

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        for name in self._EXTRA_UPDATES:
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._wrap_extra_updates()

    def _add(self, finite: Tensor, count: int | Tensor, nonfinite: Tensor | None = None) -> None:
        """Add finite terms (exactly), a count and ``[nan, +inf, -inf]`` counts to the states."""
        self._add_limbs(exact_sum(finite), count, nonfinite)

    def _add_limbs(self, limbs: Tensor, count: int | Tensor, nonfinite: Tensor | None = None) -> None:
        """Add an exact sum already in limbs, a count and ``[nan, +inf, -inf]`` counts to the states."""
        current = getattr(self, self._LIMBS)
        total = normalize(current + limbs.to(current.device))
        check_total(total, f"{type(self).__name__}'s sum")
        setattr(self, self._LIMBS, total)
        self.count += torch.as_tensor(count, dtype=torch.int64).to(self.count.device)
        if nonfinite is not None:
            self.nonfinite += nonfinite.to(self.nonfinite.device)

    def _exact_mean(self) -> float:
        """``sum / count`` correctly rounded; NaN for no count or NaN terms, ``+-inf`` for infinite terms."""
        nan, pos, neg = (int(v) for v in self.nonfinite.tolist())
        if int(self.count) == 0 or nan or (pos and neg):
            return math.nan
        if pos or neg:
            return math.inf if pos else -math.inf
        return exact_mean(getattr(self, self._LIMBS), self.count)

    def _apply(self, fn: Callable, exclude_state: Sequence[str] = ()) -> torch.nn.Module:
        # Let torchmetrics move/cast everything else, then move the locked states without ever casting them.
        locked = (self._LIMBS, "count", "nonfinite")
        this = super()._apply(fn, exclude_state=tuple(exclude_state) + locked)
        for name in locked:
            setattr(this, name, getattr(this, name).to(device=this.device, dtype=torch.int64))
            defaults = metric_defaults(this)
            defaults[name] = defaults[name].to(device=this.device, dtype=torch.int64)
        return this


def count_nonfinite(values: Tensor) -> Tensor:
    """``[nan, +inf, -inf]`` counts of ``values`` as an int64 tensor.

    Examples:
        >>> count_nonfinite(torch.tensor([1.0, float("nan"), float("inf"), float("inf")]))
        tensor([1, 2, 0])
    """
    return torch.stack(
        (
            torch.isnan(values).sum(dtype=torch.int64),
            torch.isposinf(values).sum(dtype=torch.int64),
            torch.isneginf(values).sum(dtype=torch.int64),
        )
    )


__all__ = ["ExactMetric", "count_nonfinite"]
