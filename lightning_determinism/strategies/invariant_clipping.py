"""Gradient clipping in the invariant mode of the Trainer's and Fabric's strategies: the norm summed exactly.

Where Lightning clips:

- **Trainer**: ``Trainer(gradient_clip_val=..., gradient_clip_algorithm=...)`` reaches the precision plugin, after
  ``on_before_optimizer_step``: ``LightningModule.configure_gradient_clipping`` → ``LightningModule.clip_gradients``
  → ``Precision.clip_gradients`` → ``Precision.clip_grad_by_norm`` (or ``clip_grad_by_value``), which calls
  ``torch.nn.utils.clip_grad_norm_``. In the invariant mode the strategy gives its own precision plugin (inside each
  rank, from ``setup`` to ``teardown``) a subclass of the plugin's class whose ``clip_grad_by_norm`` is
  :func:`~lightning_determinism.invariance.clipping.clip_grad_norm_exact_`: what runs around it (AMP's unscaling,
  the fused-optimizer check, a user's ``configure_gradient_clipping``) stays Lightning's. A plugin with a
  ``clip_grad_by_norm`` of its own (FSDP1's, which refuses norm clipping) keeps it.
- **Fabric**: ``fabric.clip_gradients(module, optimizer, max_norm=...)`` calls the strategy's
  ``clip_gradients_norm``, overridden in the invariant mode (:func:`clip_fabric_gradients_norm`).

Clipping by value is elementwise: the same bits on any sharding already, so it stays Lightning's (tested).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision
from typing_extensions import override

from lightning_determinism.invariance.clipping import clip_grad_norm_exact_


class ExactNormClippingMixin:
    """Put before a Lightning ``Precision`` class: clipping by norm with the exact, sharding-invariant total norm.

    Examples:
        >>> plugin = Precision()
        >>> restore = clip_exactly(plugin)
        >>> isinstance(plugin, ExactNormClippingMixin), type(plugin).__qualname__  # checkpoint keys stay Lightning's
        (True, 'Precision')
        >>> restore()
        >>> type(plugin) is Precision
        True
    """

    @override
    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:  # type: ignore[misc]
        clip_grad_norm_exact_(list(self.main_params(optimizer)), float(clip_val))  # type: ignore[attr-defined]


@functools.cache
def _exact_class(cls: type) -> type:
    """``cls`` with :class:`ExactNormClippingMixin` in front, named as ``cls`` (checkpoints key precision by name)."""
    names = {"__qualname__": cls.__qualname__, "__module__": cls.__module__, "__doc__": cls.__doc__}
    return type(cls.__name__, (ExactNormClippingMixin, cls), names)


def clip_exactly(plugin: Precision) -> Callable[[], None]:
    """Make a precision plugin clip by the exact norm; returns what puts it back as it was.

    A plugin whose class overrides ``clip_grad_by_norm`` (FSDP1's refuses it, DeepSpeed's engine clips) is left as
    it is.
    """
    cls: type = type(plugin)
    if isinstance(plugin, ExactNormClippingMixin) or type(plugin).clip_grad_by_norm is not Precision.clip_grad_by_norm:
        return lambda: None
    plugin.__class__ = _exact_class(cls)

    def restore() -> None:
        plugin.__class__ = cls

    return restore


def clip_fabric_gradients_norm(
    precision: Any, optimizer: Any, max_norm: float, norm_type: float, error_if_nonfinite: bool
) -> torch.Tensor:
    """What Fabric's ``Strategy.clip_gradients_norm`` does, with the exact norm: unscale, then clip.

    Raises:
        ValueError: for a ``norm_type`` other than 2 (exact here) or ``inf`` (a maximum: exact anyway, torch's).
    """
    precision.unscale_gradients(optimizer)
    parameters = list(precision.main_params(optimizer))
    if float(norm_type) == math.inf:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite)
    if float(norm_type) != 2.0:
        raise ValueError(
            "world-size-invariant training clips by the 2-norm (summed exactly) or the inf-norm: `norm_type` must be"
            f" 2.0 or inf, got {norm_type!r}"
        )
    return clip_grad_norm_exact_(parameters, float(max_norm), error_if_nonfinite=error_if_nonfinite)


__all__ = ["ExactNormClippingMixin", "clip_exactly", "clip_fabric_gradients_norm"]
