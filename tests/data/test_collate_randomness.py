"""Randomness drawn in a ``collate_fn`` (masking, as ``DataCollatorForLanguageModeling`` does) resumes bitwise.

A stream's batch is collated under a seed of its own, from (rank, worker, epoch, items the worker delivered before
it); a per-sample map-style loader's under one from (epoch, the batch's indices). Each resumed loader is compared with
the uninterrupted one bit for bit: ids, masked inputs and masks. Before the fix a resumed worker's collate drew from
where the worker's stream stood after its replay (or restored state), not where the uninterrupted collate drew.

In process: converted loaders without a Trainer, 0 or 2 forked workers. Under the Trainer: one child process, 2 gloo
ranks x 2 workers, a user's stream and (with the streaming extra) a Hugging Face stream, resumed mid-epoch twice in a
row (``tests/helpers/scripts/stream_run.py``).
"""

import importlib.util
import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from lightning_determinism.data.positions import PLAN_ATTR
from lightning_determinism.data.resumable import make_resumable
from lightning_determinism.data.worker_seeding import LoaderSeeding
from tests.helpers import CHILD_TIMEOUT_S, child_env, warm
from tests.helpers.datasets import mask_collate

HAS_DATASETS = importlib.util.find_spec("datasets") is not None


class Buffered(IterableDataset):
    """Shards itself by worker, shuffles through a buffer and adds noise, all from the worker's torch stream."""

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        buffer = []
        for i in range(worker, 40, workers):
            buffer.append(i)
            if len(buffer) == 4:
                yield {"id": buffer.pop(int(torch.randint(4, ()))), "x": torch.randn(6)}
        while buffer:
            yield {"id": buffer.pop(), "x": torch.randn(6)}


class Noisy(Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        return {"id": i, "x": torch.randn(6)}


def plain_collate(items):
    return {key: torch.stack([torch.as_tensor(item[key]) for item in items]) for key in ("id", "x")}


def drawing_collate(items):
    """``plain_collate``, after drawing from python's, numpy's and torch's streams."""
    return {**plain_collate(items), "drawn": torch.tensor([random.random(), np.random.rand(), torch.rand(())])}


def assert_bitwise(tail: list[dict], again: list[dict]) -> None:
    assert len(again) == len(tail) > 0
    for a, b in zip(tail, again, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a), int(a["id"][0])


def resumed_stream(dataset, k: int, workers: int, collate=mask_collate):
    """The uninterrupted epoch's batches after ``k`` and those of a loader resumed there."""
    uninterrupted = make_resumable(DataLoader(dataset, batch_size=4, num_workers=workers, collate_fn=collate), None)
    iterator = iter(uninterrupted)
    head = [next(iterator) for _ in range(k)]
    position = uninterrupted._ldet_position.at(k)
    tail = list(iterator)
    resumed = make_resumable(DataLoader(dataset, batch_size=4, num_workers=workers, collate_fn=collate), None)
    setattr(resumed, PLAN_ATTR, {"epoch": 0, "stream": position})
    torch.rand(7)  # the model's draws in between reach neither the stream nor its collate
    return head, tail, list(resumed)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_resumed_mid_epoch_collates_the_same_masks(workers):
    head, tail, again = resumed_stream(Buffered(), 3, workers)  # 3 batches: worker 1 is due, with 2 workers
    assert_bitwise(tail, again)
    masks = [batch["chosen"] for batch in head + tail]
    assert all(mask.any() for mask in masks) and len({mask.numpy().tobytes() for mask in masks}) == len(masks)


def test_a_collate_that_draws_does_not_move_the_stream_it_collates():
    """The items (the buffer's order, their noise) are the stream's alone: what an elastic resume relies on."""

    def epoch(collate):
        return list(make_resumable(DataLoader(Buffered(), batch_size=4, num_workers=2, collate_fn=collate), None))

    assert_bitwise(epoch(plain_collate), [{key: batch[key] for key in ("id", "x")} for batch in epoch(drawing_collate)])


def per_sample_loader(workers: int, per_sample: bool) -> DataLoader:
    loader = DataLoader(Noisy(), batch_size=4, shuffle=True, num_workers=workers, collate_fn=mask_collate)
    LoaderSeeding(base_seed=3, rank=0, per_sample=per_sample).prepare(loader, "train")
    return make_resumable(loader, None)


@pytest.mark.parametrize("per_sample", [True, False], ids=["per-sample", "replayed"])
def test_a_map_style_loader_with_workers_resumed_mid_epoch_collates_the_same_masks(per_sample):
    uninterrupted = per_sample_loader(2, per_sample)
    iterator = iter(uninterrupted)
    [next(iterator) for _ in range(3)]
    start, tail = uninterrupted._ldet_epoch_start, list(iterator)
    resumed = per_sample_loader(2, per_sample)
    setattr(resumed, PLAN_ATTR, {"epoch": 0, "skip": 3, "epoch_start": start})
    assert_bitwise(tail, list(resumed))


def test_per_sample_seeding_collates_the_same_batches_whatever_the_workers():
    batches = [list(per_sample_loader(workers, True)) for workers in (0, 2)]
    assert_bitwise(*batches)


@pytest.mark.skipif(not HAS_DATASETS, reason="needs datasets (.[streaming])")
@pytest.mark.parametrize("shuffled", [True, False], ids=["replayed", "its-state"])
def test_a_hugging_face_stream_resumed_in_workers_collates_the_same_masks(shuffled):
    from datasets import Dataset as HFDataset

    data = {"id": list(range(40)), "x": torch.randn(40, 6, generator=torch.Generator().manual_seed(0)).tolist()}
    stream = HFDataset.from_dict(data).to_iterable_dataset(num_shards=4)
    stream = (stream.shuffle(seed=1, buffer_size=6) if shuffled else stream).with_format("torch")
    _, tail, again = resumed_stream(stream, 3, 2)
    assert_bitwise(tail, again)


# The Trainer's runs: a user's stream (always) and Hugging Face's (with the streaming extra), 2 ranks x 2 workers.
CONFIGS = [{"name": "plain-mlm", "source": "plain", "workers": 2, "collate": "mlm", "chain": [3]}] + (
    [{"name": "hf-mlm", "source": "hf", "own_samplers": True, "workers": 2, "collate": "mlm", "chain": [3, 5]}]
    if HAS_DATASETS
    else []
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One child process: each config's uninterrupted run, then its resumes in a row."""
    root = tmp_path_factory.mktemp("collate")
    script = Path(__file__).parents[1] / "helpers" / "scripts" / "stream_run.py"
    process = warm.start([sys.executable, str(script), "configs", str(root), json.dumps(CONFIGS)], env=child_env())
    out, err = process.communicate(timeout=CHILD_TIMEOUT_S)
    assert process.returncode == 0, out[-3000:] + err[-5000:]
    return root


def result(path: Path) -> dict:
    return json.loads((path / "result.json").read_text())


@pytest.mark.distributed
@pytest.mark.parametrize("config", CONFIGS, ids=[config["name"] for config in CONFIGS])
def test_a_stream_masked_in_its_collate_resumes_bitwise_on_two_ranks(runs, config):
    straight = result(runs / config["name"] / "straight")
    assert straight["global_step"] == 16  # 64 samples, 2 ranks, batches of 4, 2 epochs
    for n, k in enumerate(config["chain"], start=1):  # each resumes the previous resumed run
        resumed = result(runs / config["name"] / "chain" / f"r{n}")
        later = {step: record for step, record in straight["steps"].items() if int(step) > k}
        assert resumed["steps"] == later  # every rank's sample ids, the bits of each masked sample, the synced loss
        assert resumed["params"] == straight["params"] and resumed["optimizer"] == straight["optimizer"]
