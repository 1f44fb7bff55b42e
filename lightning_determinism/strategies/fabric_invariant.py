"""World-size-invariant training in a hand-written Fabric loop (LitGPT's): the micro-batches the loop marks.

The Trainer knows where a micro-batch starts and ends; a Fabric loop says it with the calls it makes anyway::

    K = fabric.strategy.micro_batches_per_rank  # B / (m * W)
    for i, batch in enumerate(loader):
        is_accumulating = (i + 1) % K != 0
        with fabric.no_backward_sync(model, enabled=is_accumulating):  # micro-batch starts: reseeded
            loss = model(batch)
            fabric.backward(loss / K)  # a leaf of the gradient tree; the K-th finishes the tree
        if not is_accumulating:
            optimizer.step()
            optimizer.zero_grad()

- entering ``fabric.no_backward_sync`` (the strategy's backward-sync control, replaced) starts a micro-batch: the
  generators are reseeded from ``derive_seed(base, "micro-batch", step, j)``; DDP's own gradient sync never runs;
- on one device Fabric's ``no_backward_sync`` does not reach the strategy: the micro-batch starts at its first
  forward with gradients enabled (a forward pre-hook on the module);
- ``fabric.backward`` (the strategy's ``backward``) adds the micro-batch's gradient as a leaf; the ``K``-th climbs the
  tree with the other processes and leaves the mean gradient of all ``M`` micro-batches;
- ``optimizer.step()`` (the strategy's ``optimizer_step``) counts the step;
- ``fabric.save`` / ``fabric.load`` of a :class:`~lightning_determinism.FabricRNGState` carry that count
  (:meth:`FabricInvariantLoop.state`, :meth:`FabricInvariantLoop.load_state`): a resumed loop's micro-batches draw
  the seeds of the steps it continues, not step 0's again.

A loop that marks the micro-batches otherwise (a backward outside ``no_backward_sync``, the ``K``-th marked
accumulating, a step before the ``K``-th backward) gets an error naming what to change: never other bits silently.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_determinism.errors import DeterminismWarning
from lightning_determinism.invariance.invariant import InvariantTraining

_LOOP = (
    "`with fabric.no_backward_sync(model, enabled=is_accumulating): loss = model(...); fabric.backward(loss / K)`"
    " per micro-batch, `is_accumulating = (i + 1) % K != 0` with `K = fabric.strategy.micro_batches_per_rank`,"
    " then `optimizer.step(); optimizer.zero_grad()` after the K-th"
)


class _InvariantBackwardSyncControl:
    """What ``fabric.no_backward_sync`` enters in the invariant mode: the start of a micro-batch, no DDP sync."""

    def __init__(self, loop: FabricInvariantLoop) -> None:
        self.loop = loop

    @contextmanager
    def no_backward_sync(self, module: torch.nn.Module, enabled: bool) -> Iterator[None]:
        # DDP's sync is off for every micro-batch (require_backward_grad_sync=False): nothing to block here.
        self.loop.start_micro_batch(accumulating=enabled)
        yield


class FabricInvariantLoop:
    """The invariant mode of one Fabric strategy: the micro-batches of the user's loop, checked and reseeded.

    Args:
        invariant: the configuration, seeds, sampler and gradient tree (shared with the Trainer's strategies).
        marks_micro_batches: whether ``fabric.no_backward_sync`` reaches the strategy (DDP; not on one device).

    Examples:
        >>> loop = FabricInvariantLoop(InvariantTraining(8, 2), marks_micro_batches=False)
        >>> loop.invariant.per_rank  # known once launched: here one process
        4
    """

    def __init__(self, invariant: InvariantTraining, marks_micro_batches: bool) -> None:
        self.invariant = invariant
        self.marks_micro_batches = marks_micro_batches
        self.launched = False
        self.step = 0  # optimizer steps taken
        self.open = False  # a micro-batch started, its backward not yet run
        self.finished = False  # the step's K-th backward ran: the gradients wait for optimizer.step()
        self.parameters: list[torch.nn.Parameter] = []
        self.train_loader_set_up = False
        self._hook: Any = None

    def control(self) -> _InvariantBackwardSyncControl:
        """The backward-sync control ``fabric.no_backward_sync`` enters."""
        return _InvariantBackwardSyncControl(self)

    def _where(self) -> str:
        return f"[rank: {self.invariant.rank}] world-size-invariant training under Fabric"

    def module_set_up(self, module: torch.nn.Module, wrapped: torch.nn.Module) -> None:
        """``fabric.setup(model)``: refuse batch norm, keep the parameters' order, start at micro-batch 0."""
        self.invariant.check_module(module)
        self.parameters = [p for p in module.parameters() if p.requires_grad]
        self.open = self.finished = False
        if self._hook is not None:
            self._hook.remove()
        self._hook = None
        if not self.marks_micro_batches:
            self._hook = wrapped.register_forward_pre_hook(self._forward_started)

    def _forward_started(self, module: torch.nn.Module, args: Any) -> None:
        if not self.open and module.training and torch.is_grad_enabled():
            self.start_micro_batch(accumulating=None)

    def start_micro_batch(self, accumulating: bool | None) -> None:
        """Reseed for the micro-batch about to run; ``accumulating``: what the loop marked it (``None``: unmarked).

        Raises:
            RuntimeError: for a micro-batch started twice, before ``optimizer.step()``, or marked against ``K``.
        """
        invariant = self.invariant
        if self.open:
            raise RuntimeError(
                f"{self._where()}: `fabric.no_backward_sync` was entered again before the micro-batch it started ran"
                f" `fabric.backward`: one entry per micro-batch, {_LOOP}"
            )
        if self.finished:
            raise RuntimeError(
                f"{self._where()}: a micro-batch started after the K={invariant.per_rank}-th micro-batch of step"
                f" {self.step} and before `optimizer.step()`: {_LOOP}"
            )
        index = invariant.begun()
        if index == 0 and any(p.grad is not None for p in self.parameters):
            raise RuntimeError(
                f"{self._where()}: step {self.step} starts with gradients left in the parameters: call"
                " `optimizer.zero_grad()` (set_to_none=True, the default) after `optimizer.step()`"
            )
        last = index + 1 == invariant.per_rank
        if accumulating is not None and accumulating == last:
            said = "accumulating (enabled=True)" if accumulating else "not accumulating (enabled=False)"
            raise RuntimeError(
                f"{self._where()}: micro-batch {index + 1} of K={invariant.per_rank} of step {self.step} is marked"
                f" {said}; only the K-th is not accumulating: {_LOOP}"
            )
        invariant.before_micro_batch(self.step)
        self.open = True

    def before_backward(self) -> None:
        """Refuse a backward no micro-batch was started for."""
        if not self.open:
            where = "`fabric.no_backward_sync(model, ...)`" if self.marks_micro_batches else "a training forward"
            raise RuntimeError(
                f"{self._where()}: `fabric.backward` ran without {where} before it, so its randomness and gradient"
                f" would not follow the micro-batch: {_LOOP}"
            )

    def after_backward(self) -> None:
        """Add the micro-batch's gradient to the tree; the step's ``K``-th finishes it."""
        last = self.invariant.last_micro_batch()
        self.invariant.after_backward(self.parameters, self.step)
        self.open = False
        self.finished = last

    def before_optimizer_step(self) -> None:
        """Refuse a step whose gradients are not the finished tree."""
        if not self.finished:
            raise RuntimeError(
                f"{self._where()}: `optimizer.step()` after {self.invariant.begun()} of the"
                f" K={self.invariant.per_rank} micro-batches of step {self.step}: the gradients are not summed yet."
                f" {_LOOP}"
            )

    def after_optimizer_step(self) -> None:
        """The step is taken: the next micro-batch is the next step's first."""
        self.finished = False
        self.step += 1

    def state(self) -> dict[str, int]:
        """What ``fabric.save`` keeps (in :class:`~lightning_determinism.FabricRNGState`): the batch sizes, the step.

        A save between the micro-batches of a step keeps no gradients: a warning, the resumed loop restarts the step.

        Examples:
            >>> FabricInvariantLoop(InvariantTraining(8, 2), marks_micro_batches=False).state()
            {'global_batch_size': 8, 'micro_batch_size': 2, 'step': 0}
        """
        invariant = self.invariant
        begun = invariant.begun()
        if begun or self.finished:
            rank_zero_warn(
                f"`fabric.save` after {begun or invariant.per_rank} of the K={invariant.per_rank}"
                f" micro-batches of step {self.step}, before its `optimizer.step()`: the checkpoint holds no gradients,"
                f" a loop resumed from it restarts step {self.step} at its first micro-batch. Save after"
                " `optimizer.step()`.",
                category=DeterminismWarning,
            )
        return {"global_batch_size": invariant.global_batch_size, "micro_batch_size": invariant.micro_batch_size,
                "step": self.step}  # fmt: skip

    def load_state(self, saved: dict[str, Any] | None) -> None:
        """``fabric.load``: continue at the saved step (``None``: a checkpoint without it, see below).

        Raises:
            ValueError: for a checkpoint written with another ``global_batch_size`` or ``micro_batch_size``.
            RuntimeError: for a checkpoint without the step count loaded after this loop took steps (which step it
                continues is unknown). Loaded before the first step it is a warning: the seeds restart at step 0.

        Examples:
            >>> loop = FabricInvariantLoop(InvariantTraining(8, 2), marks_micro_batches=False)
            >>> loop.load_state({"global_batch_size": 8, "micro_batch_size": 2, "step": 5})
            >>> loop.step
            5
        """
        invariant = self.invariant
        if saved is None:
            if self.step > 0:
                raise RuntimeError(
                    f"{self._where()}: the checkpoint holds no step count of the invariant mode (written without"
                    f" `global_batch_size`/`micro_batch_size`, or by an older lightning-determinism) and this loop"
                    f" already took {self.step} step(s): which step it continues is unknown. Load it before the first"
                    " `optimizer.step()`"
                )
            rank_zero_warn(
                "The checkpoint holds no step count of the world-size-invariant mode (written without"
                " `global_batch_size`/`micro_batch_size`, or by an older lightning-determinism): the micro-batch seeds"
                " restart at step 0, so the resumed loop is not bitwise the uninterrupted one.",
                category=DeterminismWarning,
            )
            return
        for name, have in (("global_batch_size", invariant.global_batch_size),
                           ("micro_batch_size", invariant.micro_batch_size)):  # fmt: skip
            if int(saved[name]) != have:
                raise ValueError(
                    f"{self._where()}: `{name}` must be the checkpoint's to resume it: expected {int(saved[name])}"
                    f" (saved), got {have}"
                )
        self.step = int(saved["step"])
        self.finished = False

    def teardown(self) -> None:
        """Remove the forward pre-hook of one device."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


__all__ = ["FabricInvariantLoop"]
