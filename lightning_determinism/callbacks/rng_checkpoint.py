"""RNGStateCheckpoint: every rank's RNG state in Lightning checkpoints, restored per rank and verified.

Lightning checkpoints hold no RNG state: a resumed run draws other dropout masks, shuffles and augmentations than
the run it continues. This callback writes, under the checkpoint key ``"lightning_determinism_rng"``:

- per rank, gathered to the saving rank: :func:`~lightning_determinism.seeding.rng.capture_rng_state` (python, numpy,
  torch CPU, every CUDA device, the tracker, isolated generators) and the
  :class:`~lightning_determinism.WorkerSeedCallback` loader generators;
- a sha256 digest of each rank's state, so the restore can check that every rank got its own state back and
  that the ranks' equal/distinct pattern is the one that was saved.

Only tensors, ints, floats, strings, lists and dicts: the checkpoint loads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from typing_extensions import override

from lightning_determinism.callbacks._resume_layout import (
    _count_batches_anew,
    _deal_anew,
    _mesh_shape,
    _mid_epoch,
    _own_positions,
    _reseed,
    _same_layout,
    _warn_about_streams,
    _warn_on_other_accumulation,
    _with_grids,
)
from lightning_determinism.callbacks._resume_policy import finished_under, identity_note, refuse_mid_epoch_changes
from lightning_determinism.callbacks._step_boundaries import save_at_step_boundaries
from lightning_determinism.callbacks.run_identity import run_identity
from lightning_determinism.data.positions import (
    consumed_batches,
    loader_positions,
    mark_stream_start,
    set_plan,
    stock_positions,
)
from lightning_determinism.errors import DeterminismWarning
from lightning_determinism.invariance import elastic
from lightning_determinism.seeding.backends import determinism_report
from lightning_determinism.seeding.isolation import training_rng_state
from lightning_determinism.seeding.rank_states import CHECKPOINT_KEY, check_ranks, other_seed_message, verify_restored
from lightning_determinism.seeding.rank_states import all_gather as _all_gather
from lightning_determinism.seeding.rank_states import digest as _digest
from lightning_determinism.seeding.rng import capture_rng_state, restore_rng_state
from lightning_determinism.seeding.seeds import current_seeds

_FORMAT = 1


def _worker_callback(trainer: pl.Trainer) -> Any:
    from lightning_determinism.callbacks.worker_seed import WorkerSeedCallback

    return next((cb for cb in trainer.callbacks if isinstance(cb, WorkerSeedCallback)), None)  # type: ignore[attr-defined]


class RNGStateCheckpoint(Callback):
    """Save every rank's RNG state in checkpoints and restore it on resume, so a resumed run is bitwise exact.

    The deterministic strategies add one automatically unless the trainer already has one.

    Policies:

    - a checkpoint without RNG state: one :class:`~lightning_determinism.DeterminismWarning`; training goes on
      with the strategy's seeding;
    - a checkpoint from another world size: a warning, then every rank reseeds deterministically from
      ``derive_seed(base, "resume", global_step, rank)`` (never one rank's state copied to all);
    - missing or malformed entries: ``ValueError`` naming the key.

    After restoring, ranks exchange digests: each must hold the state saved for it, and ranks that held equal
    (distinct) states must hold equal (distinct) ones again; otherwise ``RuntimeError`` names the ranks.

    Examples:
        >>> import lightning as L
        >>> trainer = L.Trainer(callbacks=[RNGStateCheckpoint()], logger=False, enable_progress_bar=False)
        >>> any(isinstance(cb, RNGStateCheckpoint) for cb in trainer.callbacks)
        True
    """

    def __init__(self) -> None:
        self._pending: dict[str, Any] | None = None
        self._resuming = False
        self._stock = False
        self._fit_started = False
        self._evaluation_ranks: list[dict[str, Any]] | None = None
        self._configured: dict[str, Any] = {}  # run_identity at fit start: the hyper-parameters as configured
        self._saved_identity: dict[str, Any] | None = None  # the resumed checkpoint's, until said
        self._finished: str | None = None  # the limit the resumed checkpoint already reaches

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._fit_started = False
        self._saved_identity = self._finished = None
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint):
                save_at_step_boundaries(callback)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._evaluation_ranks = None
        mark_stream_start(trainer)

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._check_accumulation(trainer)
        if self._evaluation_ranks is not None and not trainer.training:
            ranks = self._evaluation_ranks  # an evaluation pass changes none of it (see cache_for_evaluation)
        else:
            ranks = _all_gather(self._local_state(trainer))  # every rank takes part; the saving rank writes them all
        invariant = getattr(trainer.strategy, "invariant", None)
        base = current_seeds()["base_seed"]
        checkpoint[CHECKPOINT_KEY] = {
            "format": _FORMAT,
            "world_size": len(ranks),
            "base_seed": -1 if base is None else int(base),
            "global_step": int(trainer.global_step),
            "ranks": ranks,
            "report": determinism_report(),  # flags, versions, seeds: what `lightning-determinism report` shows
            "invariant": invariant.state() if invariant is not None else None,  # elastic resume
            "accumulate_grad_batches": int(trainer.accumulate_grad_batches),
            "mesh": _mesh_shape(trainer),  # ModelParallelStrategy's (data_parallel, tensor_parallel), else None
            "identity": self._identity(trainer),  # the run's configuration: a resume under another one is said
        }

    def _identity(self, trainer: pl.Trainer) -> dict[str, Any]:
        """The run's identity, its optimizer fields as configured at fit start (not a scheduler's current ones)."""
        now = run_identity(trainer)
        if not self._configured:
            return now
        kept = {key: value for key, value in now.items() if not key.startswith("optimizer")}
        return {**kept, **{key: value for key, value in self._configured.items() if key.startswith("optimizer")}}

    def _local_state(self, trainer: pl.Trainer) -> dict[str, Any]:
        worker_cb = _worker_callback(trainer)
        rng = training_rng_state()  # during an evaluation pass (ModelCheckpoint at its end): training's, not its own
        return {
            "rng": rng,
            "digest": _digest(rng),
            "loaders": worker_cb.loader_states() if worker_cb is not None else {},
            "data": loader_positions(trainer),  # epoch, batches consumed, the epoch's RNG states: mid-epoch resume
        }

    def cache_for_evaluation(self, trainer: pl.Trainer) -> None:
        """At an evaluation pass's start, every rank: gather the ranks' states now, for a save during the pass.

        The pass moves none of them (it draws from its own streams, trains nothing, consumes no training batch), so
        a checkpoint written during it (:class:`~lightning_determinism.PreemptionCheckpoint`, by rank 0 alone)
        needs no collective; it is dropped at the next training batch.
        """
        self._evaluation_ranks = _all_gather(self._local_state(trainer))

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._load(trainer, checkpoint)
        if self._fit_started:
            # Strategies that restore after their setup (ModelParallelStrategy, FSDP) load the checkpoint after
            # on_fit_start: the states are put back now, still before the first iterator and step.
            self._restore_pending(trainer)

    def _load(self, trainer: pl.Trainer, checkpoint: dict[str, Any]) -> None:
        self._resuming = True
        saved = checkpoint.get(CHECKPOINT_KEY)
        if saved is None:
            rank_zero_warn(
                "The checkpoint holds no RNG state (it was written without RNGStateCheckpoint): the resumed run draws"
                " other random numbers than the run it continues.",
                category=DeterminismWarning,
            )
            self._pending = None
            self._stock = _mid_epoch(checkpoint)  # the data position is derived from Lightning's counters
            return
        invariant = getattr(trainer.strategy, "invariant", None)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self._adopt_saved_seed(trainer, saved, invariant)
            refuse_mid_epoch_changes(saved, checkpoint, invariant, current_seeds()["base_seed"], trainer.global_rank)
        self._saved_identity = saved.get("identity") if fitting else None
        if saved.get("identity") is None:  # an older checkpoint: its own warning (else said with the identity)
            _warn_on_other_accumulation(saved, trainer)
        elif fitting:
            self._finished = finished_under(checkpoint, trainer.max_epochs, trainer.max_steps)
            if self._fit_started and self._finished is not None:
                self._say_identity(trainer)  # the fit loop will not start: said now, as nothing is trained
        ranks = check_ranks(saved, CHECKPOINT_KEY)
        world_size = saved["world_size"]
        self._pending = saved
        same_world = _same_layout(saved, trainer)
        if not same_world and elastic.compatible(saved.get("invariant"), invariant):
            self._elastic_resume(trainer, saved, checkpoint, invariant)
            return
        data = ranks[trainer.global_rank].get("data") if same_world else _own_positions(ranks[0].get("data"))
        data = _with_grids(data, ranks)
        if not same_world and any(entry is not None and "loader_state" in entry for entry in data or []):
            data = _count_batches_anew(checkpoint, data)  # type: ignore[arg-type]
        if not same_world and any(entry is not None and "deal" in entry for entry in data or []):
            data = _deal_anew(checkpoint, data, world_size, trainer.world_size)  # type: ignore[arg-type]
        if (data is None or None in data) and _mid_epoch(checkpoint):
            why = (
                f"was written by {world_size} ranks and is resumed on {trainer.world_size}"
                if not same_world
                else "holds no data position (written before mid-epoch resume was supported)"
            )
            rank_zero_warn(
                f"The checkpoint was written in the middle of an epoch and {why}: the epoch in progress restarts at"
                " its first batch, as Lightning does, so the resumed run is not the uninterrupted one.",
                category=DeterminismWarning,
            )
        _warn_about_streams(data, same_world, world_size, trainer.world_size)
        set_plan(trainer, data)  # taken by the training loaders at their first batch
        worker_cb = _worker_callback(trainer)
        if worker_cb is None:
            return
        if same_world:
            worker_cb.load_loader_states(ranks[trainer.global_rank].get("loaders", {}))
        else:
            worker_cb.load_loader_states({}, resume_key=int(saved.get("global_step", 0)))

    @staticmethod
    def _adopt_saved_seed(trainer: pl.Trainer, saved: dict[str, Any], invariant: Any) -> None:
        """Where this run drew its base seed (none given), take the checkpoint's: the resume continues that run."""
        stored = saved.get("base_seed")
        steps = getattr(trainer.strategy, "_ldet_steps", None)
        adopt = getattr(steps, "adopt_resumed_seed", None)
        if stored is None or int(stored) < 0 or adopt is None or not adopt(int(stored), trainer.global_rank):
            return
        if invariant is not None:
            invariant.set_base_seed(int(stored))  # the micro-batch seeds and the invariant sampler's order
        worker_cb = _worker_callback(trainer)
        if worker_cb is not None:
            worker_cb.follow_base_seed(int(stored), trainer.global_rank)
        rank_zero_info(
            f"This run drew its base seed (none given): the resumed checkpoint's, {int(stored)}, is taken instead, so"
            f" the run continues the one it holds. Pass seed={int(stored)} to the strategy to say so."
        )

    def _elastic_resume(
        self, trainer: pl.Trainer, saved: dict[str, Any], checkpoint: dict[str, Any], invariant: Any
    ) -> None:
        """World-size-invariant training continues on another world size: the same steps, ``K'`` micro-batches each."""
        old, new = int(saved["invariant"]["micro_batches_per_rank"]), invariant.per_rank
        set_plan(trainer, elastic.data_plan(saved["ranks"][0].get("data"), old, new))
        elastic.rescale_loop_counters(checkpoint, old, new)
        self._pending = None  # no per-process RNG state to restore: every micro-batch reseeds its own
        rank_zero_info(
            f"Elastic resume of world-size-invariant training: written by {saved['world_size']} process(es) with"
            f" {old} micro-batches each per step, continued on {trainer.world_size} with {new} each."
        )
        worker_cb = _worker_callback(trainer)
        if worker_cb is not None:
            worker_cb.load_loader_states({}, resume_key=int(saved.get("global_step", 0)))

    @staticmethod
    def _check_accumulation(trainer: pl.Trainer) -> None:
        """Refuse a checkpoint between the micro-batches of an accumulated step (gradients are not saved)."""
        fit_loop = getattr(trainer, "fit_loop", None)
        if fit_loop is None or not trainer.training or trainer.accumulate_grad_batches <= 1:
            return
        consumed = consumed_batches(trainer)
        last = fit_loop.epoch_loop.batch_progress.is_last_batch
        if consumed % trainer.accumulate_grad_batches == 0 or last:
            return
        message = (
            f"A checkpoint after micro-batch {consumed} of an epoch, within an accumulation over"
            f" {trainer.accumulate_grad_batches} holds no accumulated gradients, so a run resumed from it cannot be"
            " the uninterrupted one. Checkpoint after optimizer steps: ModelCheckpoint(every_n_train_steps=...) or"
            " PreemptionCheckpoint, which both wait for the step to complete."
        )
        if trainer.state.status == TrainerStatus.INTERRUPTED:  # saving on an exception: keep the data, warn
            rank_zero_warn(message, category=DeterminismWarning)
            return
        raise RuntimeError(message)

    def _say_identity(self, trainer: pl.Trainer) -> None:
        """One line (rank 0) naming every field of the run's identity that differs from the checkpoint's."""
        saved, self._saved_identity = self._saved_identity, None
        finished, self._finished = self._finished, None
        if saved is None:
            return
        note = identity_note(saved, self._identity(trainer), finished)
        if note is not None:
            rank_zero_warn(note, category=DeterminismWarning)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._say_identity(trainer)  # the loaders exist now (the data's length); before the first batch
        if self._stock:  # the loops hold the restored counters, the loaders exist, no iterator was created yet
            self._stock = False
            set_plan(trainer, stock_positions(trainer))

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After the strategy's own seeding in setup(), before the first iterator and step.
        self._fit_started = True
        self._configured = run_identity(trainer)  # the optimizers exist; the checkpoint's state is not loaded yet
        if self._finished is not None:
            self._say_identity(trainer)  # the fit loop will not start (nothing left to train): said now
        self._restore_pending(trainer)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit_started = False

    def _restore_pending(self, trainer: pl.Trainer) -> None:
        saved, self._pending = self._pending, None
        if saved is None:
            return
        rank, world_size = trainer.global_rank, trainer.world_size
        if not _same_layout(saved, trainer):
            base = saved.get("base_seed", -1)
            base = current_seeds()["base_seed"] if base is None or base < 0 else base
            step = int(saved.get("global_step", 0))
            layout = f" (device mesh {saved.get('mesh')} -> {_mesh_shape(trainer)})" if saved.get("mesh") else ""
            rank_zero_warn(
                f"The checkpoint was written by {saved['world_size']} ranks and is resumed on {world_size}{layout}:"
                f" each rank reseeds from derive_seed(base={base}, 'resume', global_step={step}, rank) (under a device"
                " mesh, by its rule from derive_seed(base, 'resume', global_step)); the run stays"
                " reproducible but is not bitwise the uninterrupted one.",
                category=DeterminismWarning,
            )
            _reseed(trainer, int(base or 0), step, rank)
            return
        if saved.get("identity") is None:  # else said with the identity, in one line
            self._warn_on_other_seed(saved)
        entry = saved["ranks"][rank]
        restore_rng_state(entry["rng"])
        self._verify(saved, rank)

    def _warn_on_other_seed(self, saved: dict[str, Any]) -> None:
        message = other_seed_message(saved.get("base_seed", -1), current_seeds()["base_seed"])
        if message is not None:
            rank_zero_warn(message, category=DeterminismWarning)

    def _verify(self, saved: dict[str, Any], rank: int) -> None:
        verify_restored(saved, rank, _digest(capture_rng_state()))


def checkpoint_rng_size(checkpoint: dict[str, Any]) -> int:
    """Bytes of tensor data the RNG entry adds to a checkpoint (for reports and benchmarks).

    Examples:
        >>> checkpoint_rng_size({})
        0
    """
    total = 0

    def visit(obj: Any) -> None:
        nonlocal total
        if isinstance(obj, torch.Tensor):
            total += obj.numel() * obj.element_size()
        elif isinstance(obj, dict):
            for value in obj.values():
                visit(value)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                visit(value)

    visit(checkpoint.get(CHECKPOINT_KEY))
    return total


__all__ = ["CHECKPOINT_KEY", "RNGStateCheckpoint", "checkpoint_rng_size"]
