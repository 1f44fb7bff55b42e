"""Elastic resume of world-size-invariant training: a checkpoint of W processes continues, bitwise, on W'.

In the invariant mode nothing that decides a step depends on the world size
(:mod:`~lightning_determinism.invariance.invariant`), so a checkpoint written on W processes describes the same
computation on any other valid W'. Only the bookkeeping of "batches" is per process: a step is ``K = M / W``
micro-batches on each process. Resuming on W' therefore

- positions each new process after ``steps * K'`` of its own micro-batches of the interrupted epoch (its share of the
  same global order), instead of restoring per-process loader states;
- rescales Lightning's batch counters from ``K`` to ``K'`` micro-batches per step, keeping their relations, so the
  loop restarts at the same step and with the same accumulation windows;
- leaves the per-process RNG states alone: each micro-batch reseeds its randomness from (seed, step, micro-batch).
"""

from __future__ import annotations

from typing import Any


def compatible(saved: dict[str, Any] | None, current: Any) -> bool:
    """Whether a checkpoint's invariant settings (``B``, ``m``) are those of the strategy's invariant mode.

    Examples:
        >>> compatible({"global_batch_size": 16, "micro_batch_size": 4}, None)
        False
    """
    if not saved or current is None:
        return False
    return (saved.get("global_batch_size"), saved.get("micro_batch_size")) == (
        current.global_batch_size,
        current.micro_batch_size,
    )


def data_plan(
    saved_positions: list[dict[str, Any]] | None, old_per_rank: int, new_per_rank: int
) -> list[dict[str, Any]]:
    """Each training loader's position on the new world size: the same steps, ``K'`` micro-batches each.

    Examples:
        >>> data_plan([{"epoch": 1, "skip": 6, "epoch_start": {}}], old_per_rank=2, new_per_rank=4)
        [{'epoch': 1, 'skip': 12, 'epoch_start': None}]
    """
    plan = []
    for position in saved_positions or []:
        steps = int(position.get("skip", 0)) // old_per_rank
        plan.append({"epoch": int(position["epoch"]), "skip": steps * new_per_rank, "epoch_start": None})
    return plan


def _shift(counters: dict[str, int], by: int) -> None:
    for key in ("ready", "started", "processed", "completed"):
        if key in counters:
            counters[key] += by


def rescale_loop_counters(checkpoint: dict[str, Any], old_per_rank: int, new_per_rank: int) -> None:
    """Rescale the saved batch counters of the training loop from ``K`` to ``K'`` micro-batches per step, in place.

    Every counter moves by ``steps * (K' - K)``, the steps counted from the same counter, so offsets such as "the last
    batch ran but was not completed" survive.

    Examples:
        >>> ckpt = {"loops": {"fit_loop": {"epoch_loop.batch_progress": {
        ...     "total": {"ready": 6, "started": 6, "processed": 6, "completed": 5},
        ...     "current": {"ready": 2, "started": 2, "processed": 2, "completed": 1}}}}}
        >>> rescale_loop_counters(ckpt, old_per_rank=2, new_per_rank=1)
        >>> ckpt["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]
        {'ready': 1, 'started': 1, 'processed': 1, 'completed': 0}
    """
    progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress")
    if not progress or old_per_rank == new_per_rank:
        return
    for scope in ("total", "current"):
        counters = progress.get(scope)
        if counters:
            steps = int(counters.get("processed", 0)) // old_per_rank
            _shift(counters, steps * (new_per_rank - old_per_rank))


__all__ = ["compatible", "data_plan", "rescale_loop_counters"]
