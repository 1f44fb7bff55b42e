"""The determinism record under Lightning Fabric: logged through ``fabric.loggers`` by a helper the loop calls.

Fabric has no fit start, no checkpoint hook and no fit end that a strategy sees, and its strategy never sees the
loggers; so a hand-written loop calls, on every rank:

- :func:`log_determinism_record` once, after ``fabric.launch()`` and the first ``fabric.setup(model, ...)``: rank 0
  logs the record (:mod:`~lightning_determinism.callbacks._record_entries`, the Trainer's
  :class:`~lightning_determinism.DeterminismRecord` entries) through every logger given to Fabric. From then on
  every ``fabric.save(path, state)`` under a deterministic Fabric strategy writes the model's fingerprint into the
  checkpoint (``"lightning_determinism_fingerprint"``) and logs it as the Trainer does at a checkpoint;
- :func:`log_fingerprint` at the end of training (``final=True``), or wherever the loop wants one.

The step a ``fabric.save`` fingerprint is logged at is the state's own ``"global_step"``, ``"step"`` or
``"iteration"`` (the first that is an int), else the number of saves so far.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch.nn.parallel import DistributedDataParallel

from lightning_determinism.callbacks._record_entries import build_record, gather_streams
from lightning_determinism.callbacks.determinism_record import log_fingerprint as _log_fingerprint
from lightning_determinism.callbacks.determinism_record import log_record
from lightning_determinism.divergence.fingerprint import fingerprint
from lightning_determinism.divergence.run_record import CHECKPOINT_KEY, FINAL_FINGERPRINT, fingerprint_key
from lightning_determinism.errors import DeterminismWarning

_STEP_KEYS = ("global_step", "step", "iteration")


class FabricRecord:
    """What :func:`log_determinism_record` leaves on the strategy: the loggers, and the saves seen so far."""

    def __init__(self, loggers: list[Any], rank: int) -> None:
        self.loggers = loggers
        self.rank = rank
        self.saves = 0
        self.logged: dict[int, list[str]] = {}

    def on_save(self, state: dict[str, Any]) -> None:
        """Every rank, in ``fabric.save``: the fingerprint of the state's modules, into the state and the loggers."""
        # Fabric hands the strategy its forward modules: DDP's wrapper is taken off, as the checkpoint's state is.
        modules = {
            key: value.module if isinstance(value, (DistributedDataParallel, torch.nn.DataParallel)) else value
            for key, value in state.items()
            if isinstance(value, torch.nn.Module)
        }
        if not modules:
            return
        self.saves += 1
        step = next((int(state[k]) for k in _STEP_KEYS if isinstance(state.get(k), int)), self.saves)
        (only,) = modules.values() if len(modules) == 1 else (None,)
        value = fingerprint(only if only is not None else {key: m.state_dict() for key, m in modules.items()})
        state[CHECKPOINT_KEY] = {"fingerprint": value, "global_step": step}
        seen = self.logged.setdefault(step, [])
        if self.rank == 0 and value not in seen:
            seen.append(value)
            _log_fingerprint(self.loggers, fingerprint_key(step, len(seen) - 1), value, step)


def log_determinism_record(fabric: Any) -> dict[str, Any]:
    """Log the determinism record through ``fabric.loggers`` (rank 0); call it on every rank.

    Call it after ``fabric.launch()`` and the first ``fabric.setup(model, ...)`` (the ranks' streams are seeded
    then): the ranks' stream digests are gathered in one collective. From then on, ``fabric.save`` writes and logs
    the model's fingerprint (the module's docstring says at which step).

    Returns:
        The record's flat ``determinism/...`` entries (on every rank; rank 0's are the ones logged).

    Examples:
        >>> import lightning as L
        >>> fabric = L.Fabric(accelerator="cpu", devices=1, strategy="single_device_deterministic")
        >>> fabric.launch()
        >>> _ = fabric.setup(torch.nn.Linear(2, 1))
        >>> log_determinism_record(fabric)["determinism/seed_source"] in ("given", "seed_everything", "drawn")
        True
    """
    strategy = fabric.strategy
    ranks = gather_streams()
    invariant = getattr(getattr(strategy, "_ldet_invariant", None), "invariant", None)
    identity = {} if invariant is None else invariant.state()
    record = build_record(strategy, ranks, identity, getattr(strategy.precision, "precision", None))
    if hasattr(strategy, "_ldet_steps"):
        strategy._ldet_record = FabricRecord(list(fabric.loggers), fabric.global_rank)
    else:
        rank_zero_warn(
            f"log_determinism_record: {type(strategy).__name__} is not a deterministic Fabric strategy; the record is"
            " logged, but fabric.save will not write the model's fingerprint",
            category=DeterminismWarning,
        )
    if fabric.global_rank == 0:
        log_record(fabric.loggers, record)
    return record


def log_fingerprint(fabric: Any, model: Any, step: int, final: bool = False) -> str:
    """The model's fingerprint, logged through ``fabric.loggers`` (rank 0) as at a checkpoint; every rank calls it.

    Args:
        fabric: the ``Fabric`` object.
        model: the model (as ``fabric.setup`` returned it, or the module inside).
        step: the optimizer step it is taken after.
        final: log it as the end of training's (``determinism/fingerprint/final``).

    Returns:
        The fingerprint (the same on every rank; a sharded model's is the whole model's).
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"`step` must be an int >= 0, got {step!r}")
    value = fingerprint(model)  # Fabric's wrapper gives the module's own state_dict
    if fabric.global_rank == 0:
        _log_fingerprint(fabric.loggers, FINAL_FINGERPRINT if final else fingerprint_key(step), value, step)
    return value


__all__ = ["FabricRecord", "log_determinism_record", "log_fingerprint"]
