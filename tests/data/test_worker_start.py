"""A data-loader worker stuck at start (CPython's fork deadlock gh-112275) is killed and the workers forked again.

The deadlock itself cannot be provoked on demand; the test makes worker 0 of the first attempt hang before it marks
itself started, which is what the deadlocked worker looks like from the parent."""

import os
import time

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_determinism.data import _worker_start
from lightning_determinism.data.resumable import make_fork_safe
from lightning_determinism.errors import DeterminismWarning


class _Noisy(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.rand(1) + i  # drawn in the worker: the batches depend on the workers' seeds


def _loader():
    gen = torch.Generator().manual_seed(3)
    return DataLoader(_Noisy(), batch_size=2, num_workers=2, generator=gen, multiprocessing_context="fork")


def test_a_stuck_worker_is_forked_again_from_the_same_states(monkeypatch, tmp_path):
    expected = [batch.clone() for batch in make_fork_safe(_loader())]
    marker = tmp_path / "hung-once"
    started = _worker_start.StartedFlag.__call__

    def hang_first_worker_once(self, worker_id):
        if worker_id == 0 and not marker.exists():
            marker.write_text(str(os.getpid()))
            time.sleep(600)  # killed by the parent
        started(self, worker_id)

    monkeypatch.setattr(_worker_start.StartedFlag, "__call__", hang_first_worker_once)
    monkeypatch.setattr(_worker_start, "WORKER_START_TIMEOUT_S", 1.0)
    with pytest.warns(DeterminismWarning, match=r"did not start within 1 s \(attempt 1\).*gh-112275"):
        batches = [batch.clone() for batch in make_fork_safe(_loader())]
    assert marker.exists()
    assert all(torch.equal(a, b) for a, b in zip(expected, batches, strict=True)) and len(batches) == 4
    stuck = int(marker.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(stuck, 0)  # the stuck worker was killed, and reaped
