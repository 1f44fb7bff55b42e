"""NumericalBaseline: record the first steps of a run, or check a run against such a record.

The method: on one device, with fixed inputs, record the loss, the global gradient norm, per-parameter gradient
norms and parameter checksums for the first steps; then assert that the distributed run matches the record within
a stated tolerance *before* comparing its throughput or memory. A throughput ranking means nothing once the numbers
have diverged.

File format (JSON): ``{"format": 1, "world_size", "steps": [{"step", "loss", "grad_norm", "grad_norms": {name: x},
"param_norms": {name: x}, "param_fingerprints": {name: sha256}}, ...], "report": determinism_report() of rank 0}``.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_determinism.backends import determinism_report
from lightning_determinism.baseline_file import (
    DEFAULT_ATOL,
    DEFAULT_RTOL,
    FORMAT,
    first_mismatch,
    load_baseline,
    quantities,
)
from lightning_determinism.errors import DeterminismWarning
from lightning_determinism.fingerprint import fingerprint


class BaselineMismatch(RuntimeError):
    """A run left the recorded baseline: the message has the step, the quantity, both values and the difference."""


def _mean_over_ranks(value: float) -> float:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([value], dtype=torch.float64)
        if dist.get_backend() == "nccl":
            t = t.cuda()
        dist.all_reduce(t)
        return float(t.item()) / dist.get_world_size()
    return value


class NumericalBaseline(Callback):
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

    In ``"compare"`` mode a run that matches says so once, on rank 0: how many steps and quantities matched within
    which tolerance.

    The loss is the mean of the ranks' losses (one process on the global batch == DDP on its shards); gradient
    norms are taken after DDP's all-reduce, just before the optimizer step; parameter norms and fingerprints just
    after it.

    Example:
        >>> NumericalBaseline("baseline.json", steps=3, mode="record").steps
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
        self._warned = False

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.records = []
        self._mismatched_steps = []
        if self.mode == "compare":
            self._reference = load_baseline(self.path)["steps"]

    def _recording(self, trainer: pl.Trainer) -> bool:
        return len(self.records) < self.steps

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if not self._recording(trainer):
            return
        norms = {
            name: float(p.grad.detach().double().norm())
            for name, p in pl_module.named_parameters()
            if p.grad is not None
        }
        self._current = {
            "step": len(self.records),
            "grad_norm": math.sqrt(sum(n * n for n in norms.values())),
            "grad_norms": norms,
        }

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._recording(trainer) or not self._current:
            return
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        record = dict(self._current)
        record["loss"] = _mean_over_ranks(float(loss.detach()))
        record["param_norms"] = {name: float(p.detach().double().norm()) for name, p in pl_module.named_parameters()}
        record["param_fingerprints"] = {name: fingerprint(p) for name, p in pl_module.named_parameters()}
        self._current = {}
        self.records.append(record)
        if self.mode == "compare":
            self._compare(trainer, record)
        elif len(self.records) == self.steps:
            self._write(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.mode == "record" and 0 < len(self.records) < self.steps:
            self._write(trainer)  # the run was shorter than `steps`
        if self.mode == "compare" and self._reference is not None:
            compared = min(len(self.records), len(self._reference))
            per_step = len(quantities(self._reference[0], self._reference[0])) if self._reference else 0
            matched = compared - len(self._mismatched_steps)
            rank_zero_info(
                f"NumericalBaseline: {matched} of {compared} steps ({per_step} quantities each) matched {self.path}"
                f" within rtol={self.rtol:g}, atol={self.atol:g}"
                + (f"; steps {self._mismatched_steps} did not" if self._mismatched_steps else "")
            )

    def _write(self, trainer: pl.Trainer) -> None:
        if trainer.is_global_zero:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            payload = {
                "format": FORMAT,
                "world_size": trainer.world_size,
                "steps": self.records,
                "report": determinism_report(),
            }
            self.path.write_text(json.dumps(payload, indent=1))

    def _compare(self, trainer: pl.Trainer, record: dict[str, Any]) -> None:
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
        message = (
            f"[rank: {trainer.global_rank}] step {step}: {name} is {got!r}, the baseline {self.path} has {want!r}"
            f" ({why})"
        )
        if self.on_mismatch == "raise":
            raise BaselineMismatch(message)
        if not self._warned:
            self._warned = True
            warnings.warn(message, DeterminismWarning, stacklevel=2)


__all__ = ["BaselineMismatch", "NumericalBaseline"]
