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

Under FSDP2 and tensor parallel (``DTensor`` parameters) every norm is the whole tensor's
(:func:`~lightning_determinism.divergence.tensor_digest.full_norms`, no gather) and every digest the whole tensor's
(:func:`~lightning_determinism.divergence.tensor_digest.digests`), so one process, DDP, FSDP2, tensor parallel and
both record the same quantities. A parameter held whole on several ranks (DDP's replicas, what tensor parallel leaves
replicated) is checked across them: where the ranks disagree (a skipped all-reduce), every rank's value is kept
(``"by_rank"``) and compared. In ``"record"`` mode each rank's peak memory and communication time per step are
measured too (:mod:`.step_costs`).

Each rank keeps its part of a step (:class:`~lightning_determinism.divergence.baseline_ranks.StepRow`: the shards'
sums, the loss's exact sum, the replicas' values); the parts of all ranks complete it. ``"record"`` mode completes
every step with one ``all_gather`` when it writes the file, so none of its collectives runs during the recorded
steps (but the reduction of a ``DTensor`` left ``Partial``, its pending sum), and :attr:`~BaselineRecorder.records`
holds complete steps once the file is written; ``"compare"`` mode completes and
checks each step as it ends (one ``all_gather`` a step; none on one process).

File format (JSON, ``"format": 2``; format 1 files still read): ``{"format", "world_size", "run": {versions,
device, mesh, world size, batch shape, seed, strategy, launcher, precision, how memory and communication were
measured}, "steps": [{"step", "loss", "grad_norm", "grad_norms": {name: x}, "param_norms": {name: x},
"param_digests": {name: 32 hex}, "by_rank": {quantity: [x per rank]} (only where replicas disagree),
"peak_memory_bytes": [per rank], "comm_seconds": [per rank, None where not profiled]}, ...], "report":
determinism_report() of rank 0}``.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info

from lightning_determinism._compat.checks import require
from lightning_determinism._compat.features import BASELINE
from lightning_determinism.checkpoints.atomic import write_atomically
from lightning_determinism.divergence.baseline_file import (
    DEFAULT_ATOL,
    DEFAULT_RTOL,
    FORMAT,
    first_mismatch,
    load_baseline,
    quantities,
)
from lightning_determinism.divergence.baseline_ranks import StepRow, device_of, gather_rows, rank
from lightning_determinism.divergence.run_metadata import (
    batch_shapes,
    device_description,
    mesh_description,
    run_metadata,
)
from lightning_determinism.divergence.step_costs import DEFAULT_EVERY, StepCosts
from lightning_determinism.divergence.tensor_digest import float_word, is_dtensor, word_float
from lightning_determinism.errors import DeterminismWarning
from lightning_determinism.exact import TERM_LIMIT, exact_sum, fixed_point, limbs_to_fraction
from lightning_determinism.seeding.backends import determinism_report
from lightning_determinism.seeding.seeds import _rank_and_world_size


class BaselineMismatch(RuntimeError):
    """A run left the recorded baseline: the message has the step, the quantity, both values and the difference."""


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
        comm_every: in ``"record"`` mode, profile the communication of one step in ``comm_every`` (0: never; see
            :mod:`~lightning_determinism.divergence.step_costs`).

    Call :meth:`begin_step` when a step begins (optional: the next one begins when a step ends; without it the first
    step's memory is the peak since the start), :meth:`before_optimizer_step` after the backward pass (and DDP's
    all-reduce), :meth:`after_optimizer_step` after the step, on every rank; :meth:`finish` at the end. The recorded
    loss of a step is the mean of the losses of all its micro-batches on all ranks: give each micro-batch's loss to
    :meth:`add_loss` (under gradient accumulation), or the step's only one to :meth:`after_optimizer_step`. The mean
    is taken from exact sums (:mod:`~lightning_determinism.exact`), so one process on the global batch and DDP on
    its shards record the same bits when their micro-batch losses are the same.
    In ``"compare"`` mode a run that matches says so once, on rank 0.
    :meth:`set_run` adds what the recorder cannot see (strategy, launcher, precision), :meth:`record_batch` the
    batch's shape, to the file's ``"run"`` entry.

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
        comm_every: int = DEFAULT_EVERY,
    ) -> None:
        require(BASELINE)
        if mode not in ("record", "compare"):
            raise ValueError(f"`mode` must be 'record' or 'compare', got {mode!r}")
        if on_mismatch not in ("raise", "warn"):
            raise ValueError(f"`on_mismatch` must be 'raise' or 'warn', got {on_mismatch!r}")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"`steps` must be a positive int, got {steps!r}")
        for name, value in (("rtol", rtol), ("atol", atol)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"`{name}` must be a finite float >= 0, got {value!r}")
        if isinstance(comm_every, bool) or not isinstance(comm_every, int) or comm_every < 0:
            raise ValueError(f"`comm_every` must be an int >= 0, got {comm_every!r}")
        self.path = Path(path)
        self.steps = steps
        self.mode = mode
        self.rtol = float(rtol)
        self.atol = float(atol)
        self.on_mismatch = on_mismatch
        self.nonfinite_equal = bool(nonfinite_equal)
        self.comm_every = comm_every
        self.run_info: dict[str, Any] = {}
        self._costs: StepCosts | None = None
        self.records: list[dict[str, Any]] = []
        self._rows: list[StepRow] = []  # record mode: each step's words, until the file is written
        self._row = StepRow()
        self._mismatched_steps: list[int] = []
        self._reference: list[dict[str, Any]] | None = None
        self._current: dict[str, Any] = {}
        self._reset_loss()
        self._warned = False
        self._owner = type(self).__name__

    def start(self) -> None:
        """Forget earlier steps (a new run); in ``"compare"`` mode, read the baseline."""
        self.records = []
        self._rows = []
        self._mismatched_steps = []
        self._current = {}
        self._reset_loss()
        self._costs = None
        if self.mode == "compare":
            self._reference = load_baseline(self.path)["steps"]

    def set_run(self, **fields: Any) -> None:
        """Describe the run in the file's ``"run"`` entry, e.g. ``strategy=``, ``launcher=``, ``precision=``, ``mesh=``.

        Examples:
            >>> recorder = BaselineRecorder("baseline.json")
            >>> recorder.set_run(strategy="FSDPStrategy", precision="bf16-mixed")
            >>> recorder.run_info["precision"]
            'bf16-mixed'
        """
        self.run_info.update(fields)

    def record_batch(self, batch: Any) -> None:
        """Keep the shapes of the first batch's tensors (this rank's) for the file's ``"run"`` entry.

        Examples:
            >>> recorder = BaselineRecorder("baseline.json")
            >>> recorder.record_batch((torch.zeros(4, 16), torch.zeros(4)))
            >>> recorder.run_info["batch_shape"]
            [[4, 16], [4]]
        """
        if "batch_shape" not in self.run_info:
            self.run_info["batch_shape"] = batch_shapes(batch)

    def begin_step(self, module: torch.nn.Module | None = None) -> None:
        """The next optimizer step begins: its peak memory and communication are measured from here (record mode)."""
        if self.mode != "record" or not self.recording:
            return
        if self._costs is None:
            self._costs = StepCosts(self.comm_every, device_of(module) if module is not None else None)
        self._costs.begin(len(self.records))

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
        if self.mode == "record" and self._costs is None:
            self._costs = StepCosts(self.comm_every, device_of(module))
        if self._costs is not None:
            self._costs.pause()  # what follows is the recorder's work, not the step's
        named = list(module.named_parameters())
        if "device" not in self.run_info:
            self.run_info["device"] = device_description(device_of(module))
        if "mesh" not in self.run_info:
            sharded: Any = next((p for _, p in named if is_dtensor(p)), None)
            self.run_info["mesh"] = mesh_description(sharded.device_mesh if sharded is not None else None)
        self._row = StepRow()  # this rank's part of the step (no communication: the ranks' parts meet later)
        self._current = {
            "step": len(self.records),
            "grad_norm": None,  # from the whole gradients' norms, once complete
            "grad_norms": self._row.norms("grad_norms", [(name, p.grad) for name, p in named]),
        }

    def _reset_loss(self) -> None:
        self._loss_fixed = 0  # the exact sum of the step's terms, in units of 2**-64 (exact.fixed_point)
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
        if not isinstance(loss, torch.Tensor) or loss.numel() == 1:  # a step's loss: Python integers, no torch ops
            term = float(loss.detach().double().item()) if isinstance(loss, torch.Tensor) else float(loss)
            if math.isfinite(term) and abs(term) < TERM_LIMIT:  # a Python float is a double: every bit kept
                self._loss_fixed += fixed_point(term)
                self._loss_count += 1
            else:
                self._loss_unusable += 1
            return
        value = loss.detach().double().reshape(-1).cpu()
        usable = torch.isfinite(value) & (value.abs() < TERM_LIMIT)
        self._loss_fixed += int(limbs_to_fraction(exact_sum(value[usable])) * 2**64)  # exact: an integer
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
        record, row = dict(self._current), self._row
        named = list(module.named_parameters())
        record["param_norms"] = row.norms("param_norms", named)
        if self.mode == "record":  # compare mode compares norms; digests only say "bitwise" between files
            record["param_digests"] = row.digests(named)
        row.loss(self._loss_fixed, self._loss_count, self._loss_unusable)
        self._reset_loss()
        self._current = {}
        self.records.append(record)
        if self.mode == "compare":  # each step checked as it ends: its ranks' parts now (one collective)
            self._complete(record, row, [of_rank[0] for of_rank in gather_rows([row.words])])
            self._compare(record)
            return
        self._rows.append(row)  # completed when the file is written: no collective during the steps
        if self._costs is not None:
            self._costs.end()
        if len(self.records) == self.steps:
            self._write()
        else:
            self.begin_step()

    @staticmethod
    def _complete(record: dict[str, Any], row: StepRow, rows: list[list[int]]) -> None:
        """Fill in a step's values that need every rank (``rows``: each global rank's words of the step)."""
        by_rank = row.complete(record, rows)
        if by_rank:
            record["by_rank"] = by_rank
        record["grad_norm"] = math.sqrt(sum(n * n for n in record["grad_norms"].values()))

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
        """Complete every step from every rank's parts and costs (one collective), then write the file on rank 0."""
        costs: list[tuple[float, float | None]] = list(self._costs.steps) if self._costs is not None else []
        if self._costs is not None:
            self._costs.close()
        costs += [(math.nan, None)] * (len(self.records) - len(costs))
        words = [row.words + [float_word(float(c[0])), float_word(math.nan if c[1] is None else c[1])]
                 for row, c in zip(self._rows, costs, strict=False)]  # fmt: skip
        per_rank = gather_rows(words)  # every step's parts of every rank, in one collective
        for i, (record, row) in enumerate(zip(self.records, self._rows, strict=True)):
            self._complete(record, row, [of_rank[i] for of_rank in per_rank])
        if rank() != 0:
            return
        for i, record in enumerate(self.records):
            peaks, seconds = ([word_float(of_rank[i][k]) for of_rank in per_rank] for k in (-2, -1))
            record["peak_memory_bytes"] = [int(v) if math.isfinite(v) else None for v in peaks]
            record["comm_seconds"] = [v if math.isfinite(v) else None for v in seconds]
        report = determinism_report()
        run = run_metadata(report, self.run_info)
        if self._costs is not None:
            run.update(memory=self._costs.memory_kind, comm_profiled_every=self.comm_every)
        payload = {
            "format": FORMAT,
            "world_size": _rank_and_world_size()[1],
            "run": run,
            "steps": self.records,
            "report": report,
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
        message = f"[rank: {rank()}] step {step}: {name} is {got!r}, the baseline {self.path} has {want!r} ({why})"
        if self.on_mismatch == "raise":
            raise BaselineMismatch(message)
        if not self._warned:
            self._warned = True
            warnings.warn(message, DeterminismWarning, stacklevel=3)


__all__ = ["BaselineMismatch", "BaselineRecorder"]
