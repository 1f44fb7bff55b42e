"""DistributedMean: the true weighted mean over a whole evaluation set, with the same bits on any world size.

``self.log("val/loss", loss, sync_dist=True)`` logs Lightning's mean of per-rank means (of per-batch means): with
unequal batches or ranks it is not the mean over the samples, and its float sums change with the world size. This
metric sums ``value * weight`` exactly (see :mod:`~lightning_determinism.exact`) and counts the weights in int64, so
``compute()`` is the mean over everything every process saw, correctly rounded from exact values.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_determinism._compat.checks import AX_TYPE, PLOT_OUT_TYPE
from lightning_determinism.exact import TERM_LIMIT, limbs_to_float
from lightning_determinism.metrics._exact_metric import ExactMetric, count_nonfinite


def _as_values(value: Tensor | float) -> Tensor:
    if isinstance(value, Tensor):
        if not (value.is_floating_point() or value.dtype in (torch.int8, torch.int16, torch.int32, torch.int64)):
            raise TypeError(f"`value` must be a real tensor or number, got a {value.dtype} tensor")
        return value.detach()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.tensor(float(value), dtype=torch.float64)
    raise TypeError(f"`value` must be a tensor or a real number, got {value!r}")


def _as_weights(weight: Tensor | int | None, values: Tensor) -> Tensor | None:
    if weight is None:
        return None
    if isinstance(weight, bool) or not isinstance(weight, (int, Tensor)):
        raise TypeError(f"`weight` must be a non-negative int or integer tensor (a count), got {weight!r}")
    w = torch.as_tensor(weight, device=values.device)
    if w.is_floating_point() or w.is_complex() or w.dtype == torch.bool:
        raise TypeError(f"`weight` must be a non-negative int or integer tensor (a count), got a {w.dtype} tensor")
    try:
        w = torch.broadcast_to(w.long(), values.shape)
    except RuntimeError:
        raise ValueError(
            f"`weight` of shape {tuple(w.shape)} does not broadcast to `value` of shape {tuple(values.shape)}"
        ) from None
    if w.numel() and int(w.min()) < 0:
        raise ValueError(f"`weight` must be >= 0, got {int(w.min())}")
    return w


def _as_mask(mask: Tensor | None, values: Tensor) -> Tensor | None:
    if mask is None:
        return None
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        shown = f"a {mask.dtype} tensor" if isinstance(mask, Tensor) else repr(mask)
        raise TypeError(f"`mask` must be a bool tensor (True: counted), got {shown}")
    try:
        return torch.broadcast_to(mask.to(values.device), values.shape)
    except RuntimeError:
        raise ValueError(
            f"`mask` of shape {tuple(mask.shape)} does not broadcast to `value` of shape {tuple(values.shape)}"
        ) from None


class DistributedMean(ExactMetric):
    """A weighted mean with an exact sum and an exact int64 count: the same bits on 1, 2 or 8 processes.

    ``update(values)`` counts every element once; ``update(value, weight=n)`` adds ``value`` with the integer
    weight ``n`` (e.g. a batch's mean loss and its token count); ``update(values, mask=labels != -100)`` counts only
    the elements where ``mask`` is true (padding and ``ignore_index`` positions, where
    ``cross_entropy(..., reduction="none")`` gives ``0.0``, left out of the sum and the count). Each element's
    ``value * weight`` is formed in float64 and added as an exact fixed-point number, so the result depends on the
    values only, not on how they were batched, ordered or spread over processes. For a mean that is also independent
    of the batch split, pass per-element values (``reduction="none"``) rather than per-batch means.

    NaN makes the mean NaN; ``+inf``/``-inf`` make it ``+inf``/``-inf`` (NaN if both occur). A zero total weight
    gives NaN. Limits: ``|value * weight| < 2**42`` per element and a total of magnitude below ``2**55``.

    Args:
        kwargs: passed to :class:`torchmetrics.Metric` (``process_group``, ``dist_sync_on_step``, ...).

    Examples:
        >>> metric = DistributedMean()
        >>> metric.update(torch.tensor([1.0, 2.0]))
        >>> metric.update(torch.tensor(4.0), weight=2)  # a batch mean over 2 elements
        >>> metric.compute(), metric.count
        (tensor(2.7500, dtype=torch.float64), tensor(4))
        >>> padded = DistributedMean()
        >>> padded.update(torch.tensor([2.0, 4.0, 0.0]), mask=torch.tensor([-100, 5, 7]) != -100)  # a padded token
        >>> padded.compute(), padded.count
        (tensor(2., dtype=torch.float64), tensor(2))
    """

    is_differentiable = False
    higher_is_better = None
    full_state_update = False

    _LIMBS = "sum_limbs"

    sum_limbs: Tensor

    def update(  # type: ignore[override]
        self, value: Tensor | float, weight: Tensor | int | None = None, mask: Tensor | None = None
    ) -> None:
        """Add ``value`` (any shape) with ``weight`` (an integer broadcastable to it; ``None``: 1 per element).

        ``mask``: a bool tensor broadcastable to ``value``; where it is false the element counts for nothing (its
        value, even NaN or infinite, and its weight are left out).

        Raises:
            TypeError: a non-real ``value``, a non-integer ``weight`` or a ``mask`` that is not a bool tensor.
            ValueError: a negative ``weight``, a ``weight`` or ``mask`` that does not broadcast, or a term past
                ``2**42``.
        """
        values = _as_values(value)
        weights = _as_weights(weight, values)
        keep = _as_mask(mask, values)
        if keep is not None:
            weights = keep.long() if weights is None else weights * keep
        terms = values.double() if weights is None else values.double() * weights
        count = values.numel() if weights is None else int(weights.sum())
        if weights is not None:
            counted = weights != 0  # a zero weight counts nothing, even for an infinite value
            terms = terms[counted]
        special = count_nonfinite(terms)
        finite = terms[torch.isfinite(terms)]
        if finite.numel() and float(finite.abs().max()) >= TERM_LIMIT:
            biggest = float(finite.abs().max())
            raise ValueError(f"DistributedMean takes terms `value * weight` of magnitude below 2**42, got {biggest!r}")
        self._add(finite, count, special)

    @property
    def weighted_sum(self) -> Tensor:
        """This process's weighted sum as float64 (correctly rounded from the exact value)."""
        return torch.tensor(limbs_to_float(self.sum_limbs), dtype=torch.float64, device=self.sum_limbs.device)

    def compute(self) -> Tensor:
        """The weighted mean over everything seen on every process, float64."""
        return torch.tensor(self._exact_mean(), dtype=torch.float64, device=self.sum_limbs.device)

    def plot(self, val: Tensor | Sequence[Tensor] | None = None, ax: AX_TYPE | None = None) -> PLOT_OUT_TYPE:
        """Plot one value or a sequence of values (``compute()`` when ``val`` is None); needs matplotlib."""
        return self._plot(val, ax)


__all__ = ["DistributedMean"]
