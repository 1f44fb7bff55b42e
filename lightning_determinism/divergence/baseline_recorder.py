"""Record the first steps of a run, or check a run against such a record: the core, usable from any loop.

The method: on one device, with fixed inputs, record the loss, the global gradient norm, per-parameter gradient
norms and parameter checksums for the first steps; then assert that the distributed run matches the record within
a stated tolerance *before* comparing its throughput or memory. A throughput ranking means nothing once the numbers
have diverged.

:class:`BaselineRecorder` does it for a hand-written loop (plain PyTorch, Lightning Fabric)::

    recorder = BaselineRecorder("baseline.json", steps=5, mode="record")
    for step, batch in enumerate(loader):
        loss = model(batch).mean()
        loss.backward()                       # or fabric.backward(loss)
        recorder.before_optimizer_step(model)
        optimizer.step()
        optimizer.zero_grad()
        recorder.after_optimizer_step(model, loss)
    recorder.finish()

:class:`~lightning_determinism.NumericalBaseline` is the same thing as a Trainer callback.

File format (JSON): ``{"format": 1, "world_size", "steps": [{"step", "loss", "grad_norm", "grad_norms": {name: x},
"param_norms": {name: x}, "param_fingerprints": {name: sha256}}, ...], "report": determinism_report() of rank 0}``.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_info

from lightning_determinism.checkpoints.atomic import write_atomically
from lightning_determinism.divergence.baseline_file import (
    DEFAULT_ATOL,
    DEFAULT_RTOL,
    FORMAT,
    first_mismatch,
    load_baseline,
    quantities,
)
from lightning_determinism.divergence.fingerprint import fingerprint
from lightning_determinism.errors import DeterminismWarning
from lightning_determinism.exact import TERM_LIMIT, exact_mean, exact_sum, normalize, zero_limbs
from lightning_determinism.seeding.backends import determinism_report
from lightning_determinism.seeding.seeds import _rank_and_world_size


class BaselineMismatch(RuntimeError):
    """A run left the recorded baseline: the message has the step, the quantity, both values and the difference."""


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _rank() -> int:
    return _rank_and_world_size()[0]


def _exact_mean_over_ranks(limbs: torch.Tensor, count: int, unusable: int) -> float:
    """The mean of every rank's terms from each rank's exact sum and counts: the same bits on any world size.

    NaN when a rank had no term, or a term that was not finite or too large for the exact sum.
    """
    totals = torch.cat((limbs, torch.tensor([count, unusable], dtype=torch.int64)))
    if _distributed():
        if dist.get_backend() == "nccl":
            totals = totals.cuda()
        dist.all_reduce(totals)  # int64: exact in any order
        totals = totals.cpu()
    if int(totals[4]) > 0:
        return float("nan")
    return exact_mean(normalize(totals[:3]), totals[3])


class BaselineRecorder:
    """Record the first ``steps`` optimizer steps into ``path``, or compare a run against that record.

    Args:
        path: the JSON file (written by rank 0 in ``"record"`` mode, read in ``"compare"`` mode).
        steps: how many steps to record or compare.
        mode: ``"record"`` or ``"compare"``.
        rtol: relative tolerance for ``"compare"`` (default ``1e-4``, see docs/divergence.md).
        atol: absolute tolerance for ``"compare"`` (default ``1e-6``).
        on_mismatch: ``"raise"`` (:class:`BaselineMismatch`) or ``"warn"`` (a ``DeterminismWarning``, once).
        nonfinite_equal: count identical NaN/``inf`` values on both sides as equal (by default a non-finite value
            is always a mismatch).

    Call :meth:`before_optimizer_step` after the backward pass (and DDP's all-reduce), :meth:`after_optimizer_step`
    after the step, on every rank; :meth:`finish` at the end. The recorded loss of a step is the mean of the losses of
    all its micro-batches on all ranks: give each micro-batch's loss to :meth:`add_loss` (under gradient
    accumulation), or the step's only one to :meth:`after_optimizer_step`. The mean is taken from exact sums
    (:mod:`~lightning_determinism.exact`), so one process on the global batch and DDP on its shards record the same
    bits when their micro-batch losses are the same. In ``"compare"`` mode a run that matches says so once, on rank 0.

    Examples:
        >>> BaselineRecorder("baseline.json", steps=3, mode="record").steps
        3
    """

    def __init__(
        self,
        path: str | Path,
        steps: int = 5,
        mode: Literal["record", "compare"] = "record",
        rtol: float = DEFAULT_RTOL,
        atol: float = DEFAULT_ATOL,
        on_mismatch: Literal["raise", "warn"] = "raise",
        nonfinite_equal: bool = False,
    ) -> None:
        if mode not in ("record", "compare"):
            raise ValueError(f"`mode` must be 'record' or 'compare', got {mode!r}")
        if on_mismatch not in ("raise", "warn"):
            raise ValueError(f"`on_mismatch` must be 'raise' or 'warn', got {on_mismatch!r}")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"`steps` must be a positive int, got {steps!r}")
        for name, value in (("rtol", rtol), ("atol", atol)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"`{name}` must be a finite float >= 0, got {value!r}")
        self.path = Path(path)
        self.steps = steps
        self.mode = mode
        self.rtol = float(rtol)
        self.atol = float(atol)
        self.on_mismatch = on_mismatch
        self.nonfinite_equal = bool(nonfinite_equal)
        self.records: list[dict[str, Any]] = []
        self._mismatched_steps: list[int] = []
        self._reference: list[dict[str, Any]] | None = None
        self._current: dict[str, Any] = {}
        self._reset_loss()
        self._warned = False
        self._owner = type(self).__name__

    def start(self) -> None:
        """Forget earlier steps (a new run); in ``"compare"`` mode, read the baseline."""
        self.records = []
        self._mismatched_steps = []
        self._current = {}
        self._reset_loss()
        if self.mode == "compare":
            self._reference = load_baseline(self.path)["steps"]

    @property
    def recording(self) -> bool:
        """Whether the next step is still one of the first ``steps``."""
        return len(self.records) < self.steps

    def before_optimizer_step(self, module: torch.nn.Module) -> None:
        """Take the gradient norms (after the backward pass and any all-reduce, before the optimizer step)."""
        if not self.recording:
            return
        if self.mode == "compare" and self._reference is None:
            self.start()
        norms = {
            name: float(p.grad.detach().double().norm()) for name, p in module.named_parameters() if p.grad is not None
        }
        self._current = {
            "step": len(self.records),
            "grad_norm": math.sqrt(sum(n * n for n in norms.values())),
            "grad_norms": norms,
        }

    def _reset_loss(self) -> None:
        self._loss_sum = zero_limbs()
        self._loss_count = 0
        self._loss_unusable = 0  # non-finite, or too large for the exact sum: the step's loss is recorded as NaN

    def add_loss(self, loss: torch.Tensor | float) -> None:
        """Count one micro-batch's loss (not divided by the accumulation) towards the loss of the coming step.

        Examples:
            >>> recorder = BaselineRecorder("baseline.json", steps=1)
            >>> recorder.add_loss(0.5)
            >>> recorder.add_loss(torch.tensor(0.25))
        """
        if not self.recording:
            return
        if isinstance(loss, torch.Tensor):
            value = loss.detach().double().reshape(-1).cpu()
        else:
            value = torch.tensor([float(loss)], dtype=torch.float64)  # a Python float is a double: keep every bit
        usable = torch.isfinite(value) & (value.abs() < TERM_LIMIT)
        self._loss_sum = normalize(self._loss_sum + exact_sum(value[usable]))
        self._loss_count += int(usable.sum())
        self._loss_unusable += int((~usable).sum())

    def after_optimizer_step(self, module: torch.nn.Module, loss: torch.Tensor | float | None = None) -> None:
        """Take the loss and the parameters after the step; compare, or write the file after the last step.

        Args:
            module: the model (its parameters are recorded).
            loss: one more micro-batch loss of this step (as for :meth:`add_loss`), e.g. the step's only one.
        """
        if loss is not None:
            self.add_loss(loss)
        if not self.recording or not self._current:
            return
        record = dict(self._current)
        record["loss"] = _exact_mean_over_ranks(self._loss_sum, self._loss_count, self._loss_unusable)
        self._reset_loss()
        record["param_norms"] = {name: float(p.detach().double().norm()) for name, p in module.named_parameters()}
        record["param_fingerprints"] = {name: fingerprint(p) for name, p in module.named_parameters()}
        self._current = {}
        self.records.append(record)
        if self.mode == "compare":
            self._compare(record)
        elif len(self.records) == self.steps:
            self._write()

    def finish(self) -> None:
        """Write a record shorter than ``steps``; in ``"compare"`` mode, say how many steps matched (rank 0)."""
        if self.mode == "record" and 0 < len(self.records) < self.steps:
            self._write()  # the run was shorter than `steps`
        if self.mode == "compare" and self._reference is not None:
            compared = min(len(self.records), len(self._reference))
            per_step = len(quantities(self._reference[0], self._reference[0])) if self._reference else 0
            matched = compared - len(self._mismatched_steps)
            rank_zero_info(
                f"{self._owner}: {matched} of {compared} steps ({per_step} quantities each) matched {self.path}"
                f" within rtol={self.rtol:g}, atol={self.atol:g}"
                + (f"; steps {self._mismatched_steps} did not" if self._mismatched_steps else "")
            )

    def _write(self) -> None:
        if _rank() == 0:
            payload = {
                "format": FORMAT,
                "world_size": _rank_and_world_size()[1],
                "steps": self.records,
                "report": determinism_report(),
            }
            write_atomically(self.path, json.dumps(payload, indent=1))  # whole or not at all

    def _compare(self, record: dict[str, Any]) -> None:
        assert self._reference is not None
        step = record["step"]
        if step >= len(self._reference):
            return
        found = first_mismatch(self._reference[step], record, self.rtol, self.atol, self.nonfinite_equal)
        if found is None:
            return
        self._mismatched_steps.append(step)
        name, want, got = found
        diff = abs(want - got) if want is not None and got is not None else float("nan")
        finite = all(isinstance(v, (int, float)) and math.isfinite(v) for v in (want, got))
        why = (
            f"difference {diff:.3e}; rtol={self.rtol:g}, atol={self.atol:g}"
            if finite
            else "a non-finite value never matches; nonfinite_equal=True accepts identical ones"
        )
        message = f"[rank: {_rank()}] step {step}: {name} is {got!r}, the baseline {self.path} has {want!r} ({why})"
        if self.on_mismatch == "raise":
            raise BaselineMismatch(message)
        if not self._warned:
            self._warned = True
            warnings.warn(message, DeterminismWarning, stacklevel=3)


__all__ = ["BaselineMismatch", "BaselineRecorder"]
