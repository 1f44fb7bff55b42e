"""Map-style loaders with workers, resumed mid-epoch without per-sample seeds: workers take over the right roles.

Without ``WorkerSeedCallback(per_sample=True)`` a worker's random numbers (augmentations) continue from one batch it
serves to the next: batch ``b`` of an epoch is drawn by worker ``b % K`` from the state its earlier batches ``b - K,
b - 2K, ...`` left. A resumed iterator hands its first batch ``c`` to worker 0, PyTorch restarting its round-robin, so
each new worker ``j`` takes over the role of the worker that served batch ``c + j`` in the uninterrupted run:

- it is seeded as that worker was (``WorkerSeedCallback``'s seed for it, else PyTorch's own);
- the user's ``worker_init_fn`` runs with that worker's id;
- it fetches the batches that worker served before ``c`` (the dataset's ``__getitems__`` or ``__getitem__`` and the
  loader's ``collate_fn``, as PyTorch's fetcher does) and drops them, without the model.

The indices of those batches come from the epoch's index order, drawn once more from its saved RNG states. Costs:
the consumed part of the epoch is read again, spread over the workers (``per_sample=True`` needs no replay).
"""

from __future__ import annotations

import random
from itertools import islice
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from lightning_determinism._compat.data import sampler_iter, torch_worker_numpy_seed


class WorkerReplay:
    """What the workers of a resumed iterator need: the consumed batches' indices and how a batch is fetched."""

    def __init__(self, skip: int, workers: int, batches: list[Any], collate: Any, batched: bool) -> None:
        self.skip, self.workers, self.batches, self.collate, self.batched = skip, workers, batches, collate, batched

    def role(self, worker_id: int) -> int:
        """The worker of the uninterrupted run whose batches worker ``worker_id`` serves now."""
        return (self.skip + worker_id) % self.workers

    def replay(self, role: int) -> None:
        """Fetch and drop the batches worker ``role`` served before the checkpoint (in the worker)."""
        info = get_worker_info()
        dataset = info.dataset if info is not None else None
        for indices in self.batches[role :: self.workers]:
            if not self.batched:
                self.collate(dataset[indices])  # type: ignore[index]
            elif getattr(dataset, "__getitems__", None):
                self.collate(dataset.__getitems__(indices))  # type: ignore[union-attr]
            else:
                self.collate([dataset[i] for i in indices])  # type: ignore[index]


class RoleWorkerInit:
    """The ``worker_init_fn`` of a resumed iterator's workers (see the module notes); picklable for spawned workers."""

    def __init__(self, inner: Any, replay: WorkerReplay) -> None:
        self.inner, self.plan = inner, replay

    def __call__(self, worker_id: int) -> None:
        role = self.plan.role(worker_id)
        iterator_seed = torch.initial_seed() - worker_id  # PyTorch seeds worker w with iterator_seed + w
        start_as = getattr(self.inner, "start_as", None)
        if callable(start_as):  # WorkerSeedCallback's seeds, then the user's function
            start_as(role, iterator_seed)
        else:  # PyTorch's own seeds for that worker, then the user's function
            random.seed(iterator_seed + role)
            torch.manual_seed(iterator_seed + role)
            np.random.seed(torch_worker_numpy_seed(iterator_seed, role))
            if self.inner is not None:
                self.inner(role)
        self.plan.replay(role)


def consumed_indices(loader: Any, create_single: Any, skip: int) -> list[Any]:
    """The indices of the epoch's first ``skip`` batches: drawn by a single-process iterator of ``loader``.

    ``create_single()`` creates it (with the epoch's saved RNG states in place): it draws the iterator's seed and the
    sampler's order as the uninterrupted run's iterator did, and reads no sample.
    """
    workers, timeout = loader.num_workers, loader.timeout
    loader.num_workers, loader.timeout = 0, 0  # a single-process iterator accepts no timeout
    try:
        indices = sampler_iter(create_single())
    finally:
        loader.num_workers, loader.timeout = workers, timeout
    if indices is None:  # pragma: no cover  (a single-process iterator always has one)
        raise RuntimeError("the loader's single-process iterator has no index iterator")
    return [list(batch) if isinstance(batch, (list, tuple)) else batch for batch in islice(indices, skip)]


__all__ = ["RoleWorkerInit", "WorkerReplay", "consumed_indices"]
