"""A preemption during an evaluation pass of ``fit``: stop at the next evaluation batch, save the training state.

Waiting for a validation pass to end may take longer than the grace period a scheduler leaves before ``SIGKILL``.
The training state to save exists during the pass, unchanged: evaluation trains nothing, and it draws from streams
of its own (:mod:`~lightning_determinism.seeding.isolation`). So :class:`~lightning_determinism.PreemptionCheckpoint`
stops at the next evaluation batch:

- **Agreement without a collective.** Ranks may be at different batches (evaluation loaders need not give every
  rank as many batches), and a collective in the middle of a pass would pair with another rank's own. A rank that
  received the signal at batch ``b`` proposes, through the process group's key-value store, to stop at ``b + 1``;
  the first proposal wins; a rank stops at the first batch at or past it. Ranks whose steps synchronise (a per-step
  ``sync_dist``) are at most one batch apart, so they all stop before the same batch.
- **No collective in the save.** The ranks' RNG states and data positions are gathered when the pass starts
  (:meth:`RNGStateCheckpoint.cache_for_evaluation`); rank 0 alone dumps and writes the checkpoint; the others wait
  for it in the store.
- **The pass runs again after the resume.** The checkpoint's evaluation counters say "restarted in the middle of
  the pass", so Lightning runs the whole pass again before training goes on, as the uninterrupted run did.

During the sanity check nothing has been trained since the run started: the processes exit without a checkpoint.
"""

from __future__ import annotations

import copy
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl

from lightning_determinism._compat.access import default_store, dump_checkpoint
from lightning_determinism._process import distributed

_WAIT_FOR_RANK_ZERO = timedelta(minutes=10)
_VAL_PROGRESS = "epoch_loop.val_loop.batch_progress"


def _store() -> Any:
    if distributed():
        return default_store()
    return None


class EvaluationStop:
    """One evaluation pass of ``fit``: where it started, and the ranks' agreement to stop in it."""

    def __init__(self) -> None:
        self.batch = -1
        self.stop_at: int | None = None
        self.progress: dict[str, Any] | None = None
        self.key = ""
        self.where: tuple[int, int, int] | None = None
        self.passes = 0

    def start(self, trainer: pl.Trainer) -> None:
        """At the pass's start (every rank, in step): its counters, and the ranks' training state gathered."""
        self.batch, self.stop_at = -1, None
        # The same on every rank (not a count kept per process: a popen rank 0 may have run other fits before).
        where = (trainer.global_step, trainer.current_epoch, int(trainer.sanity_checking))
        self.passes = self.passes + 1 if where == self.where else 0
        self.where = where
        self.key = "ldet-preempt/" + "/".join(map(str, (*where, self.passes)))
        if trainer.sanity_checking:
            self.progress = None
            return
        loop = trainer.fit_loop.epoch_loop.val_loop
        self.progress = copy.deepcopy(loop.batch_progress.state_dict())
        from lightning_determinism.callbacks.rng_checkpoint import RNGStateCheckpoint

        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(callback, RNGStateCheckpoint):
                callback.cache_for_evaluation(trainer)

    def should_stop(self, signum: int) -> bool:
        """At each evaluation batch's start: whether to stop before it (``signum``: this rank's signal, 0 if none)."""
        self.batch += 1
        store = _store()
        if store is None:
            return bool(signum)
        if self.stop_at is None:
            if signum:  # the first proposal wins; every rank reads the winner
                self.stop_at = int(store.compare_set(self.key, "", str(self.batch + 1)))
            elif store.check([self.key]):
                self.stop_at = int(store.get(self.key))
        return self.stop_at is not None and self.batch >= self.stop_at

    def save(self, trainer: pl.Trainer, path: Any, link: Any) -> None:
        """Rank 0 writes the training state to ``path`` (then ``link(trainer, path)``); the others wait for it."""
        store = _store()
        if trainer.is_global_zero:
            checkpoint = dump_checkpoint(trainer)
            self._restart_the_pass(checkpoint)
            trainer.strategy.save_checkpoint(checkpoint, path)
            link(trainer, path, barrier=False)
            if store is not None:
                store.set(f"{self.key}/written", "1")
        elif store is not None:
            store.wait([f"{self.key}/written"], _WAIT_FOR_RANK_ZERO)

    def _restart_the_pass(self, checkpoint: dict[str, Any]) -> None:
        """The pass's counters as if its first batch had started and not finished: Lightning reruns the pass."""
        fit = checkpoint.get("loops", {}).get("fit_loop", {})
        if self.progress is None or _VAL_PROGRESS not in fit:
            return
        progress = copy.deepcopy(self.progress)
        for counters, started in ((progress["total"], 1), (progress["current"], 1)):
            counters["ready"] = counters["completed"] + started
            counters["started"] = counters["completed"] + started
            counters["processed"] = counters["completed"]
        progress["is_last_batch"] = False
        fit[_VAL_PROGRESS] = progress


__all__ = ["EvaluationStop"]
