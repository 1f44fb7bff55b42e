"""What ``RNGStateCheckpoint`` does with a checkpoint of another configuration: refuse it, or say it in one line.

The rule (DESIGN.md, checkpoints): a resume under another configuration is refused or said in one line before
training, never silently different.

- Refused, in the middle of an epoch: another step of the world-size-invariant mode (another ``global_batch_size`` or
  ``micro_batch_size``, the mode turned on or off) and another base seed. The saved position is a count of batches in
  an order that the step and the seed decide (the invariant mode deals ``B`` samples per step over the ranks, a
  shuffling sampler orders the epoch by the seed), so the rest of the epoch would train some samples twice and others
  never (:func:`refuse_mid_epoch_changes`). At an epoch boundary nothing of the epoch is lost: allowed, and said.
- Said in one line (:func:`identity_note`), rank 0, before training: every other field of
  :func:`~lightning_determinism.callbacks.run_identity.run_identity` that differs, as ``name: old -> new``, with what
  it does; a new optimizer hyper-parameter is ignored (Lightning restores the optimizer's state, hyper-parameters
  included), and a checkpoint that already ends training under the new limits trains nothing. Another world size or
  mesh alone (and what follows from it: batches per epoch and rank, the invariant mode's ``K``) adds no line: the
  resume on another layout says it in its own message.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning_determinism.callbacks.run_identity import identity_changes

_STEP = ("global_batch_size", "micro_batch_size")
# What follows from the number of ranks and their mesh: a resume on another layout says it in its own message (an
# elastic resume, the deal of the rest of the epoch, the reseed), so these alone add no line.
_LAYOUT = frozenset({"world_size", "mesh", "micro_batches_per_rank", "train_batches"})


def interrupted_epoch(checkpoint: Mapping[str, Any]) -> tuple[int, int] | None:
    """``(epoch, batches consumed)`` of a training epoch a checkpoint interrupts, ``None`` at an epoch boundary.

    A checkpoint written at an epoch's last batch (``ModelCheckpoint(every_n_train_steps=...)``) leaves nothing of
    the epoch to train: a boundary.

    Examples:
        >>> loops = {"fit_loop": {"epoch_progress": {"current": {"started": 1, "processed": 0}},
        ...          "epoch_loop.batch_progress": {"current": {"processed": 3}, "is_last_batch": False}}}
        >>> interrupted_epoch({"loops": loops})
        (0, 3)
        >>> interrupted_epoch({})
    """
    fit_loop = checkpoint.get("loops", {}).get("fit_loop", {})
    epochs = fit_loop.get("epoch_progress", {}).get("current", {})
    if not epochs or epochs.get("processed", 0) >= epochs.get("started", 0):
        return None
    batches = fit_loop.get("epoch_loop.batch_progress", {})
    if batches.get("is_last_batch", False):
        return None
    return int(epochs.get("processed", 0)), int(batches.get("current", {}).get("processed", 0))


def _step_of(invariant: Mapping[str, Any] | None) -> str:
    if not invariant:
        return "without the world-size-invariant mode"
    return "with " + ", ".join(f"{key}={invariant.get(key)}" for key in _STEP)


def refuse_mid_epoch_changes(
    saved: Mapping[str, Any], checkpoint: Mapping[str, Any], current_invariant: Any, base_seed: int | None, rank: int
) -> None:
    """Refuse to resume an interrupted epoch under another invariant step or base seed (see the module's docstring).

    ``saved``: the checkpoint's ``RNGStateCheckpoint`` entry; ``current_invariant``: the strategy's
    ``InvariantTraining`` or ``None``.

    Raises:
        RuntimeError: naming what changed and how to resume.

    Examples:
        >>> loops = {"fit_loop": {"epoch_progress": {"current": {"started": 1, "processed": 0}},
        ...          "epoch_loop.batch_progress": {"current": {"processed": 1}}}}
        >>> saved = {"invariant": {"global_batch_size": 8, "micro_batch_size": 4}, "base_seed": 3}
        >>> refuse_mid_epoch_changes(saved, {"loops": loops}, None, 3, rank=0)
        Traceback (most recent call last):
        ...
        RuntimeError: [rank: 0] The checkpoint was written 1 batch into epoch 0 with global_batch_size=8, ...
    """
    where = interrupted_epoch(checkpoint)
    if where is None:
        return
    epoch, batches = where
    head = f"[rank: {rank}] The checkpoint was written {batches} batch{'' if batches == 1 else 'es'} into epoch {epoch}"
    if "invariant" in saved:  # older entries hold no invariant settings: nothing to compare
        before = saved["invariant"]
        now = current_invariant.state() if current_invariant is not None else None
        if [(before or {}).get(key) for key in _STEP] != [(now or {}).get(key) for key in _STEP]:
            raise RuntimeError(
                f"{head} {_step_of(before)} and is resumed {_step_of(now)}: the saved position counts batches of"
                " the epoch's order as that step deals it over the ranks, so under another step the rest of the epoch"
                f" would train some samples twice and others never. Resume {_step_of(before)} to finish the epoch, or"
                " from a checkpoint written at an epoch boundary, where the step may change."
            )
    stored = saved.get("base_seed")
    if stored is not None and stored >= 0 and base_seed is not None and int(stored) != int(base_seed):
        raise RuntimeError(
            f"{head} by a run with base seed {stored}, and this run's base seed is {base_seed}: everything derived"
            " from the base seed (per-sample, worker and micro-batch seeds; a DistributedSampler's or the invariant"
            " mode's order of the epoch) follows it, so the rest of the epoch would not be the rest of the saved run's"
            f" (in another order: some samples trained twice and others never). Resume with seed={stored} (the"
            f" strategy's `seed`, or seed_everything({stored})) to continue it, or from a checkpoint written at an"
            " epoch boundary to go on under another seed."
        )


def finished_under(checkpoint: Mapping[str, Any], max_epochs: int | None, max_steps: int) -> str | None:
    """The limit a checkpoint already reaches (then the resumed fit trains nothing), else ``None``.

    Examples:
        >>> loops = {"fit_loop": {"epoch_progress": {"current": {"processed": 2}}}}
        >>> finished_under({"loops": loops, "global_step": 8}, max_epochs=2, max_steps=-1)
        'max_epochs=2 (2 epochs done)'
        >>> finished_under({"loops": loops, "global_step": 8}, max_epochs=3, max_steps=-1)
    """
    fit_loop = checkpoint.get("loops", {}).get("fit_loop", {})
    done = fit_loop.get("epoch_progress", {}).get("current", {})
    epochs = int(done.get("processed", 0))
    if done.get("started", 0) > epochs and fit_loop.get("epoch_loop.batch_progress", {}).get("is_last_batch"):
        epochs += 1  # written at the last batch of an epoch: that epoch has nothing left to train
    if max_epochs is not None and max_epochs >= 0 and epochs >= max_epochs:
        return f"max_epochs={max_epochs} ({epochs} epoch{'' if epochs == 1 else 's'} done)"
    step = int(checkpoint.get("global_step", 0))
    if max_steps >= 0 and step >= max_steps:
        return f"max_steps={max_steps} ({step} step{'' if step == 1 else 's'} done)"
    return None


def _consequence(name: str, old: Any, new: Any, invariant: bool) -> str:
    if name.startswith("optimizer") and "." in name:
        return (
            f" (Lightning restores the checkpoint's optimizer state, hyper-parameters included: this run trains with"
            f" {old}, the new value is ignored)"
        )
    if name.startswith("optimizer"):
        return f" (the checkpoint's {old} state is loaded into {new})"
    if name == "base_seed":
        return (
            f" (the saved RNG states are restored, everything derived from the base seed follows {new}: not the"
            f" continuation of the saved run; resume with seed={old} to continue it)"
        )
    if name == "accumulate_grad_batches" and not invariant:  # the invariant mode sets it from B, m and the world
        return " (every later optimizer step sums other micro-batches)"
    return ""


def identity_note(saved: Mapping[str, Any], current: Mapping[str, Any], finished: str | None = None) -> str | None:
    """The one line that says what differs from the run that wrote the checkpoint; ``None`` when nothing does.

    Examples:
        >>> print(identity_note({"optimizer.lr": 0.1, "max_epochs": 2}, {"optimizer.lr": 0.01, "max_epochs": 2},
        ...                     finished="max_epochs=2 (2 epochs done)"))  # doctest: +ELLIPSIS
        Resuming a checkpoint written under another configuration: optimizer.lr: 0.1 -> 0.01 (... trains with 0.1, ...
        >>> identity_note({"max_epochs": 2}, {"max_epochs": 2}) is None
        True
        >>> identity_note({"world_size": 2, "train_batches": 4}, {"world_size": 1, "train_batches": 8}) is None
        True
    """
    changes = identity_changes(saved, current)
    invariant = any(side.get(key) is not None for side in (saved, current) for key in _STEP)
    layout = _LAYOUT | {"accumulate_grad_batches"} if invariant else _LAYOUT  # the invariant mode's K = B / (m W)
    if all(change.partition(": ")[0] in layout for change in changes):
        return None
    parts = []
    for change in changes:
        name, _, values = change.partition(": ")
        old, _, new = values.partition(" -> ")
        parts.append(change + _consequence(name, saved.get(name, old), current.get(name, new), invariant))
    line = "Resuming a checkpoint written under another configuration: " + "; ".join(parts)
    if finished is not None:
        line += f"; the checkpoint already reaches {finished}: nothing is trained"
    return line + "."


__all__ = ["finished_under", "identity_note", "interrupted_epoch", "refuse_mid_epoch_changes"]
