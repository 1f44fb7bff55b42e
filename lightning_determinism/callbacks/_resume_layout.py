"""How ``RNGStateCheckpoint`` resumes a checkpoint written on another layout.

The data positions it keeps or deals anew, the loop counters it rescales, the reseed, and what it warns about. A
saved RNG state belongs to its rank's place (rank, world size, device-mesh coordinate): on another layout the ranks
reseed, by the mesh's rule under a device mesh. Data positions: a restriping stream (litdata) and a map-style
``DistributedSampler`` epoch (:mod:`~lightning_determinism.data.deal`) continue the interrupted epoch on the new
grid, each remaining sample once; anything else restarts it (warned).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_determinism._compat.access import device_mesh_of
from lightning_determinism.errors import DeterminismWarning
from lightning_determinism.parallel.topology import model_parallel_seed
from lightning_determinism.seeding.seeds import derive_seed, seed_all


def _reseed(trainer: pl.Trainer, base: int, step: int, rank: int) -> None:
    """Seed a rank resumed on another layout: ``derive_seed(base, "resume", step, rank)``.

    Under a topology (a device mesh): its rule from ``derive_seed(base, "resume", step)``, so tensor-parallel peers
    still share their streams.
    """
    topology = getattr(trainer.strategy, "topology", None)
    if topology is None:
        seed_all(derive_seed(base, "resume", step, rank))
        return
    distinct = bool(getattr(getattr(trainer.strategy, "_ldet_steps", None), "distinct_data_parallel", False))
    model_parallel_seed(derive_seed(base, "resume", step), topology, distinct_data_parallel=distinct)


def _mesh_shape(trainer: pl.Trainer) -> list[int] | None:
    mesh = device_mesh_of(trainer.strategy)
    return [int(size) for size in mesh.shape] if mesh is not None else None


def _same_layout(saved: dict[str, Any], trainer: pl.Trainer) -> bool:
    """The same number of ranks, each at the same mesh coordinate (a saved state belongs to its coordinate)."""
    mesh = saved.get("mesh")
    return bool(saved["world_size"] == trainer.world_size and (mesh is None or mesh == _mesh_shape(trainer)))


def _warn_on_other_accumulation(saved: dict[str, Any], trainer: pl.Trainer) -> None:
    before = saved.get("accumulate_grad_batches")
    if before is None or before == trainer.accumulate_grad_batches or saved.get("invariant") is not None:
        return  # the invariant mode sets its own from the world size (and says so)
    rank_zero_warn(
        f"The checkpoint was written with accumulate_grad_batches={before} and is resumed with"
        f" {trainer.accumulate_grad_batches}: every later optimizer step sums other micro-batches, so the run is not"
        " the uninterrupted one (each sample is still trained once per epoch).",
        category=DeterminismWarning,
    )


def _own_positions(saved: list[dict[str, Any]] | None) -> list[dict[str, Any] | None] | None:
    """On another world size, the positions of loaders that continue an interrupted epoch there; ``None`` for others.

    litdata's ``load_state_dict`` recognises a changed topology and continues the epoch's global order on the new
    grid ("elastic restripe"); a converted stream deals the rest of the old grid's epoch (``data.elastic_streams``,
    from every rank's position: :func:`_with_grids`); every other loader restarts an interrupted epoch (warned).
    """
    if not saved:
        return None
    keep = ("loader_state", "loader_epoch", "stream", "deal")
    return [entry if any(key in entry for key in keep) else None for entry in saved]


def _with_grids(data: list[Any] | None, ranks: list[dict[str, Any]]) -> list[Any] | None:
    """Each stream's entry gains every rank's position of that loader (``"grid"``; ``None`` if one is missing)."""
    if not data:
        return data
    out = []
    for slot, entry in enumerate(data):
        if entry is None or entry.get("stream") is None:
            out.append(entry)
            continue
        grid = []
        for rank in ranks:
            theirs = (rank.get("data") or [])[slot:]
            if theirs and theirs[0] and theirs[0].get("stream") and theirs[0]["epoch"] == entry["epoch"]:
                grid.append(theirs[0]["stream"])
        out.append({**entry, "grid": grid if len(grid) == len(ranks) else None})
    return out


def _count_from_zero(checkpoint: dict[str, Any]) -> None:
    """Count the interrupted epoch's batches from 0 in Lightning's loop counters; idempotent.

    The offset of a checkpoint written at a batch's end is kept; the loop then runs until the loaders' remainder is
    exhausted.
    """
    progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress", {})
    current = progress.get("current")
    if current and _mid_epoch(checkpoint):
        done = int(current.get("processed", 0))
        for key in ("ready", "started", "processed", "completed"):
            current[key] = int(current.get(key, 0)) - done


def _count_batches_anew(checkpoint: dict[str, Any], data: list[Any]) -> list[Any]:
    """A loader that restripes itself (litdata) on another world size: the loop counts the epoch's batches anew.

    Lightning's batch counter holds the interrupted epoch's batches on the old grid, and the loop stops at the new
    grid's length: the restriped remainder was cut short (samples skipped). Counted from 0 (the offset of a checkpoint
    written at a batch's end kept), the loop runs until the loader's remainder is exhausted.
    """
    _count_from_zero(checkpoint)
    fresh = {"batches": 0, "elastic": True, "origin": None}
    return [{**entry, **fresh} if entry is not None and "loader_state" in entry else entry for entry in data]


def _deal_anew(checkpoint: dict[str, Any], data: list[Any], old: int, new: int) -> list[Any]:
    """Map-style loaders under a ``DistributedSampler``, on another world: the rest of the epoch dealt anew.

    The loop counts the resumed epoch's batches from 0 (as for a restriped stream: :func:`_count_batches_anew`) and
    runs until the dealt rest is exhausted, which is never more batches than a whole epoch on the new world.
    """
    _count_from_zero(checkpoint)
    rank_zero_info(
        f"The checkpoint was written mid-epoch by {old} ranks and is resumed on {new}: the samples of the"
        " interrupted epoch not trained yet are dealt to the new ranks (each once, in the uninterrupted run's order;"
        " lightning_determinism.data.deal)."
    )
    return [{**entry, "skip": 0, "epoch_start": None} if entry is not None and "deal" in entry else entry
            for entry in data]  # fmt: skip


def _warn_about_streams(data: list[Any] | None, same_world: bool, old: int, new: int) -> None:
    """Say what a resume does to training loaders that cannot continue at their exact sample."""
    for entry in data or []:
        if entry is None:
            continue
        if entry.get("restarts"):
            why = (
                "was not made resumable (it did not pass through the deterministic strategy's process_dataloader)"
                if entry.get("dataloader")
                else "is not a torch DataLoader"
            )
            rank_zero_warn(
                f"The training loader `{entry['restarts']}` {why}, so its position in the interrupted epoch can be"
                " neither restored nor replayed: it restarts at the epoch's first batch and the samples it delivered"
                " before the checkpoint are trained on again. Wrap the data in a DataLoader (docs/streaming.md).",
                category=DeterminismWarning,
            )
        elif not same_world and "loader_state" in entry:
            rank_zero_warn(
                f"The stream's position was saved on {old} ranks and is resumed on {new}: litdata restripes the rest"
                " of the epoch over the new grid, each remaining sample once (dealt at the exact sample by the"
                " deterministic strategies), in other batches: the run is not the uninterrupted one"
                " (docs/streaming.md, elastic resume).",
                category=DeterminismWarning,
            )


def _mid_epoch(checkpoint: dict[str, Any]) -> bool:
    """Whether a Lightning checkpoint was written with a training epoch under way."""
    progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_progress", {}).get("current", {})
    return bool(progress) and progress.get("processed", 0) < progress.get("started", 0)
