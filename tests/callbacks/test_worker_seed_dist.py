"""WorkerSeedCallback on 2 gloo ranks x 2 workers x 2 epochs (fork start; one spawn-path test)."""

import json
from collections import defaultdict

import pytest
import torch
from lightning.pytorch import seed_everything
from lightning.pytorch.strategies import DDPStrategy

from lightning_determinism import DeterministicDDPStrategy, WorkerSeedCallback, derive_seed
from tests.helpers.lightning_models import fit_streams

pytestmark = pytest.mark.distributed

STREAMS = ("torch", "numpy", "python")


def _streams(samples, key=("rank", "epoch", "worker")):
    """(rank, epoch, worker) -> the draws of that worker in that epoch, in the order it produced them."""
    out = defaultdict(lambda: {s: [] for s in STREAMS})
    for sample in samples:  # recorded in training order, which is each worker's production order
        for stream in STREAMS:
            out[tuple(sample[k] for k in key)][stream].append(str(sample[stream]))
    return dict(out)


def _assert_pairwise_distinct(streams):
    for stream in STREAMS:
        draws = [d for key in streams for d in streams[key][stream]]
        assert len(draws) == len(set(draws)), f"{stream}: two workers drew the same numbers"


def _ddp(seed=5, start_method="fork"):
    return DeterministicDDPStrategy(seed=seed, start_method=start_method)


# Lightning's own DDPStrategy, for comparison. A rank it forks cannot fork its data-loader workers safely on Python
# <= 3.11 (CPython gh-112275: about one fit in 300 leaves a worker stuck at start forever; our strategies restart it,
# see data/_worker_start.py; a CI run met it here), so its workers come from a fork server, a single-threaded process
# (8 s more than forking, 6 s less than spawning): PyTorch seeds them the same way whatever the start method. The
# fork server imports the package only where a worker_init_fn of the package's is unpickled.
PLAIN_WORKERS = {"worker_context": "forkserver"}
WITH_CALLBACK = {"worker_context": "forkserver+package"}


def test_eight_distinct_streams_reproducible_epoch_zero_included(tmp_path):
    first, _ = fit_streams(_ddp(), tmp_path / "a", [WorkerSeedCallback()])
    torch.manual_seed(123)  # a different parent state must not matter
    second, _ = fit_streams(_ddp(), tmp_path / "b", [WorkerSeedCallback()])
    streams = _streams(first)
    assert sorted(streams) == [(r, e, w) for r in (0, 1) for e in (0, 1) for w in (0, 1)]
    _assert_pairwise_distinct(streams)
    assert streams == _streams(second)
    for sample in first:  # epoch 0 too: every worker was seeded by the documented formula
        iterator_seed = int(sample["pytorch_worker_seed"]) - sample["worker"]
        assert int(sample["torch_seed"]) == derive_seed(5, sample["rank"], sample["worker"], iterator_seed)


def test_without_the_callback_lightning_repeats_streams_across_ranks(tmp_path):
    seed_everything(5, verbose=False)
    samples, _ = fit_streams(DDPStrategy(start_method="fork"), tmp_path, [], epochs=1, **PLAIN_WORKERS)
    streams = _streams(samples)
    for worker in (0, 1):  # the failure the callback prevents: both ranks' workers draw the same numbers
        for stream in STREAMS:
            assert streams[(0, 0, worker)][stream] == streams[(1, 0, worker)][stream]


def test_users_worker_init_fn_runs_after_ours(tmp_path):
    samples, _ = fit_streams(_ddp(), tmp_path, [WorkerSeedCallback()], epochs=1, user_init=True)
    streams = _streams(samples)
    for (_rank, _epoch, worker), draws in streams.items():
        expected = torch.rand(3, generator=torch.Generator().manual_seed(1000 + worker)).tolist()
        assert draws["torch"][0] == str(expected)  # the user's override won for torch
    assert streams[(0, 0, 0)]["numpy"] != streams[(1, 0, 0)]["numpy"]  # ours still seeded the rest


def test_persistent_workers_stay_distinct_and_reproducible(tmp_path):
    kw = {"persistent_workers": True}
    first, _ = fit_streams(_ddp(), tmp_path / "a", [WorkerSeedCallback()], **kw)
    second, _ = fit_streams(_ddp(), tmp_path / "b", [WorkerSeedCallback()], **kw)
    streams = _streams(first)
    assert len(streams) == 8
    _assert_pairwise_distinct(streams)
    assert streams == _streams(second)


def test_lightning_ddp_strategy_and_seed_everything(tmp_path):
    seed_everything(9, verbose=False)
    samples, trainer = fit_streams(
        DDPStrategy(start_method="fork"), tmp_path, [WorkerSeedCallback()], epochs=1, **WITH_CALLBACK
    )
    _assert_pairwise_distinct(_streams(samples))
    for sample in samples:
        iterator_seed = int(sample["pytorch_worker_seed"]) - sample["worker"]
        assert int(sample["torch_seed"]) == derive_seed(9, sample["rank"], sample["worker"], iterator_seed)


def test_dict_of_loaders_gets_distinct_streams(tmp_path):
    samples, _ = fit_streams(_ddp(), tmp_path, [WorkerSeedCallback()], epochs=1, loaders="dict")
    streams = _streams(samples, key=("rank", "epoch", "worker", "tag"))
    assert len(streams) == 8  # 2 ranks x 2 workers x 2 loaders
    _assert_pairwise_distinct(streams)


@pytest.mark.parametrize(
    ("devices", "num_workers", "batch_size"), [(1, 0, 2), (1, 1, 3), (1, 2, 2), (2, 0, 3), (2, 2, 2)]
)
def test_per_sample_is_invariant(tmp_path, devices, num_workers, batch_size):
    strategy = _ddp(seed=3) if devices == 2 else "single_device_deterministic"
    if devices == 1:
        seed_everything(3, verbose=False)
    kw = {"num_workers": num_workers, "batch_size": batch_size, "n": 12}
    samples, _ = fit_streams(strategy, tmp_path, [WorkerSeedCallback(per_sample=True)], devices=devices, **kw)
    values = {(s["epoch"], s["index"]): [s["torch"], s["numpy"], s["python"]] for s in samples}
    assert len(values) == 2 * 12
    reference = _per_sample_reference(3, 12)
    assert values == reference


def _per_sample_reference(base, n):
    """What dataset[i] draws under the documented per-sample seed, computed in this process."""
    import random

    import numpy as np

    out = {}
    for epoch in (0, 1):
        for index in range(n):
            seed = derive_seed(base, "sample", epoch, index)
            out[(epoch, index)] = [
                torch.rand(3, generator=torch.Generator().manual_seed(seed)).tolist(),
                float(np.random.RandomState(seed).rand()),
                random.Random(seed).random(),
            ]
    return out


def test_spawn_path(spawn_fit):
    # Spawned ranks spawn their workers too (multiprocessing's default in a spawned process): the worker_init_fn
    # travels pickled. One worker per rank: each spawned worker imports torch (~4 s of CPU). The fit (seed 5, one
    # epoch, 8 samples of StreamDataset beside the main loader): conftest.py's spawn_fit.
    samples = [sample for rank in (0, 1) for sample in json.loads((spawn_fit / f"samples-rank{rank}.json").read_text())]
    assert len(samples) == 8
    streams = _streams(samples)
    assert sorted(streams) == [(0, 0, 0), (1, 0, 0)]
    _assert_pairwise_distinct(streams)
    for sample in samples:  # seeded by the documented formula in the spawned worker, not inherited
        iterator_seed = int(sample["pytorch_worker_seed"]) - sample["worker"]
        assert int(sample["torch_seed"]) == derive_seed(5, sample["rank"], sample["worker"], iterator_seed)
