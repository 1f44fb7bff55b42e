"""Map-style loaders with workers resumed mid-epoch without per-sample seeds: each worker takes over the role of the
worker that served the next batch and replays its earlier fetches, so the rest of the epoch is bitwise the
uninterrupted one (in process: the loader's own resume plan, 2 workers, skips that shift the roles or not)."""

import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from lightning_determinism.data.positions import PLAN_ATTR
from lightning_determinism.data.resumable import make_resumable
from lightning_determinism.data.worker_seeding import LoaderSeeding


class Augmented(Dataset):
    """Every item draws from python, numpy and torch (an augmentation), in the worker that fetches it."""

    def __len__(self) -> int:
        return 30

    def __getitem__(self, i: int):
        return torch.tensor([float(i), random.random(), float(np.random.rand())]), torch.rand(2)


def loader(seeding: str, roles: torch.Tensor | None = None) -> DataLoader:
    data = DataLoader(Augmented(), batch_size=3, shuffle=True, num_workers=2, worker_init_fn=RecordRole(roles),
                      generator=torch.Generator().manual_seed(7))  # fmt: skip
    if seeding == "WorkerSeedCallback":
        LoaderSeeding(base_seed=3, rank=0, per_sample=False).prepare(data, "train")
    return make_resumable(data, None)


class RecordRole:
    """The user's worker_init_fn: notes, per worker process, the worker id it was called with (shared memory)."""

    def __init__(self, roles: torch.Tensor | None) -> None:
        self.roles = roles

    def __call__(self, worker_id: int) -> None:
        if self.roles is not None:
            self.roles[get_worker_info().id] = worker_id


@pytest.mark.parametrize("seeding", ["WorkerSeedCallback", "torch"])
@pytest.mark.parametrize("consumed", [1, 2, 5])
def test_workers_without_per_sample_seeds_resume_mid_epoch_bitwise(seeding, consumed):
    uninterrupted = loader(seeding)
    iterator = iter(uninterrupted)
    for _ in range(consumed):
        next(iterator)
    start = uninterrupted._ldet_epoch_start
    rest = list(iterator)
    torch.manual_seed(99)  # whatever the run drew in between
    resumed = loader(seeding)
    setattr(resumed, PLAN_ATTR, {"epoch": 0, "skip": consumed, "epoch_start": start})
    again = list(resumed)
    assert len(again) == len(rest) == 10 - consumed
    for (x, noise), (x2, noise2) in zip(rest, again, strict=True):
        assert torch.equal(x, x2) and torch.equal(noise, noise2)


def test_the_users_worker_init_fn_gets_the_id_of_the_worker_whose_role_it_takes():
    uninterrupted = loader("WorkerSeedCallback")
    iterator = iter(uninterrupted)
    next(iterator)
    start = uninterrupted._ldet_epoch_start
    roles = torch.full((2,), -1, dtype=torch.int64).share_memory_()
    resumed = loader("WorkerSeedCallback", roles)
    setattr(resumed, PLAN_ATTR, {"epoch": 0, "skip": 1, "epoch_start": start})
    list(resumed)
    assert roles.tolist() == [1, 0]  # batch 1 was worker 1's: the new worker 0 serves it
    assert type(resumed.worker_init_fn).__name__ == "_SeedWorker"  # the role wrapper was only there at creation


def test_the_role_taking_worker_init_fn_survives_pickling_for_spawned_workers():
    import pickle

    from lightning_determinism.data._worker_replay import RoleWorkerInit, WorkerReplay

    data = loader("WorkerSeedCallback")
    replay = WorkerReplay(3, 2, [[0, 1, 2], [3, 4, 5], [6, 7, 8]], data.collate_fn, batched=True)
    again = pickle.loads(pickle.dumps(RoleWorkerInit(data.worker_init_fn, replay)))  # what a spawn context sends
    assert [again.plan.role(w) for w in (0, 1)] == [1, 0] and again.plan.batches[1::2] == [[3, 4, 5]]
    assert type(again.inner).__name__ == "_SeedWorker" and again.inner.base_seed == 3
