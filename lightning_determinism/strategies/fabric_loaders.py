"""What ``fabric.setup_dataloaders`` does to a loader under the deterministic Fabric strategies.

Called by ``DeterministicFabricStrategyMixin.process_dataloader`` (:mod:`~lightning_determinism.strategies.fabric`)
once Fabric has processed the loader:

- in the invariant mode the first loader (the training one) is ordered by the base seed, the loaders after it
  (evaluation) count every sample once (:func:`~lightning_determinism.data.samplers.unpad_eval_dataloader`);
- a loader with a state of its own (litdata) keeps it (:mod:`~lightning_determinism.data.stateful`);
- a ``DataLoader``'s workers, shuffle and (``per_sample``) samples are seeded as the Trainer's
  :class:`~lightning_determinism.WorkerSeedCallback` seeds them
  (:class:`~lightning_determinism.data.worker_seeding.LoaderSeeding`), and it resumes mid-epoch
  (:mod:`~lightning_determinism.data.resumable`, :mod:`~lightning_determinism.data.fabric_epoch`): its epoch is the
  number of times it has been iterated, and the strategy remembers it to warn about positions a save leaves out.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils.data import DataLoader

from lightning_determinism.data.resumable import make_resumable
from lightning_determinism.data.samplers import unpad_eval_dataloader
from lightning_determinism.data.stateful import is_stateful_loader, make_stateful
from lightning_determinism.data.worker_seeding import LoaderSeeding


def prepare_loader(strategy: Any, dataloader: DataLoader) -> DataLoader:
    """Seed ``dataloader`` and make it resumable for ``strategy`` (a ``DeterministicFabricStrategyMixin``).

    Raises:
        RuntimeError: in the invariant mode before the first ``fabric.setup(model, ...)``, or before
            ``fabric.launch()`` (the base seed is unknown).
    """
    loop = strategy._ldet_invariant
    if loop is not None and not loop.train_loader_set_up:  # the first loader is the training one
        if not strategy._ldet_model_ready:
            raise RuntimeError(
                "world-size-invariant training orders the training loader by the base seed, settled at the first"
                " `fabric.setup(model, ...)`: call it before `fabric.setup_dataloaders(...)`"
            )
        dataloader = loop.invariant.process_train_loader(dataloader, strategy.global_rank, strategy.world_size)
        loop.train_loader_set_up = True
    elif loop is not None:  # evaluation: every sample once (Fabric's DistributedSampler pads), as on one process
        dataloader = unpad_eval_dataloader(dataloader)  # type: ignore[assignment]
    if is_stateful_loader(dataloader):  # litdata: its own position, saved by FabricRNGState at the last batch
        return make_stateful(dataloader, None)
    if not isinstance(dataloader, DataLoader):
        return dataloader
    base = strategy._ldet_steps.base_seed
    if base is None:
        raise RuntimeError("`fabric.setup_dataloaders` ran before `fabric.launch()`: the base seed is unknown")
    epoch = torch.zeros((), dtype=torch.int64).share_memory_()
    if strategy.seed_workers:
        if strategy._ldet_seeding is None:
            owner = f"{type(strategy).__name__}(per_sample=True)" if strategy.per_sample else type(strategy).__name__
            strategy._ldet_seeding = LoaderSeeding(base, strategy.global_rank, strategy.per_sample, owner=owner)
        strategy._ldet_seeding.prepare(dataloader, "train", epoch)
    # Every loader resumes mid-epoch: FabricRNGState keeps a stream's position, a map-style loader's batches drawn.
    dataloader = make_resumable(dataloader, None)  # type: ignore[assignment]
    dataloader._ldet_epoch = epoch  # set at each iter() (see resumable)
    dataloader._ldet_iterations = 0
    dataloader._ldet_backwards = lambda: strategy._ldet_backwards  # see data.fabric_epoch
    strategy._ldet_loaders.append(weakref.ref(dataloader))
    return dataloader


__all__ = ["prepare_loader"]
