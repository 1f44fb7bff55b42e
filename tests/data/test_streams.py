"""Streams in one process: the batch order a resumed epoch restores, replay and its check, the state protocol."""

import importlib.util
import itertools
import os
import random
import threading
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from lightning_determinism.data.elastic_streams import Checks, Grid, Layout, OldStream, share
from lightning_determinism.data.positions import PLAN_ATTR
from lightning_determinism.data.resumable import make_resumable
from lightning_determinism.data.stream_state import has_state_protocol
from lightning_determinism.data.streams import StreamIterator, StreamPosition, Tagged
from lightning_determinism.errors import DeterminismWarning


def round_robin(counts: list[int], start: list[int]) -> list[tuple[int, int]]:
    """PyTorch's order of (worker, batch index) over workers with ``counts`` batches, from batch ``start[w]`` on."""
    order, index = [], list(start)
    while any(index[w] < counts[w] for w in range(len(counts))):
        for w in range(len(counts)):
            if index[w] < counts[w]:
                order.append((w, index[w]))
                index[w] += 1
    return order


@pytest.mark.parametrize("counts", [[4, 4, 4], [5, 2, 4], [1, 6, 3], [3, 3, 0]])
@pytest.mark.parametrize("consumed", [0, 1, 2, 4, 5, 7])
def test_a_resumed_epoch_hands_out_batches_in_the_uninterrupted_order(counts, consumed):
    full = round_robin(counts, [0] * len(counts))
    if consumed >= len(full):
        pytest.skip("the epoch is over")
    done, rest = full[:consumed], full[consumed:]
    delivered = [sum(1 for w, _ in done if w == worker) for worker in range(len(counts))]
    first = (done[-1][0] + 1) % len(counts) if done else 0
    # The resumed iterator: every worker skipped what it delivered; PyTorch restarts its round-robin at worker 0.
    inner = iter([Tagged(w, 1, 0, None, None, (w, i)) for w, i in round_robin(counts, delivered)])
    position = StreamPosition(len(counts))
    assert list(StreamIterator(inner, position, first, None)) == rest


class Noisy(IterableDataset):
    """Noise drawn in the stream, through a shuffle buffer: a function of the seeds the strategies give it."""

    def __iter__(self):
        buffer = []
        for i in range(24):
            buffer.append(i)
            if len(buffer) == 4:
                yield {"id": buffer.pop(random.randrange(4)), "noise": torch.randn(2)}
        yield from ({"id": i, "noise": torch.randn(2)} for i in buffer)


class Drifting(IterableDataset):
    """A source that changes between reads (its order is not a function of the seeds)."""

    reads = itertools.count()

    def __iter__(self):
        offset = next(self.reads)
        return iter([{"id": (i + offset) % 24} for i in range(24)])


def resumed_batches(dataset, k: int, batch_size: int = 3):
    uninterrupted = make_resumable(DataLoader(dataset, batch_size=batch_size), None)
    iterator = iter(uninterrupted)
    head = [next(iterator) for _ in range(k)]
    saved = {"epoch": 0, "stream": uninterrupted._ldet_position.at(k)}
    tail = list(iterator)
    resumed = make_resumable(DataLoader(dataset, batch_size=batch_size), None)
    setattr(resumed, PLAN_ATTR, saved)
    return head, tail, list(resumed)


def test_a_stream_read_in_process_replays_its_own_draws_whatever_the_model_drew():
    head, tail, again = resumed_batches(Noisy(), 3)
    torch.rand(100)  # the model's draws between the runs do not reach the stream
    assert len(head) == 3 and len(tail) == 5
    for a, b in zip(tail, again, strict=True):
        assert torch.equal(a["id"], b["id"]) and torch.equal(a["noise"], b["noise"])


def test_a_stream_that_does_not_replay_is_warned_about_and_the_count_kept():
    with pytest.warns(DeterminismWarning, match="did not replay the samples it delivered"):
        _, tail, again = resumed_batches(Drifting(), 2)
    assert len(again) == len(tail)  # as many samples as were left, not the same ones


def test_a_deterministic_stream_resumes_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeterminismWarning)
        resumed_batches(Noisy(), 4)


@pytest.mark.skipif(importlib.util.find_spec("datasets") is None, reason="needs datasets (.[streaming])")
def test_a_hugging_face_stream_uses_its_state_unless_it_shuffles_through_a_buffer():
    from datasets import Dataset

    stream = Dataset.from_dict({"id": list(range(8))}).to_iterable_dataset(num_shards=2)
    assert has_state_protocol(stream)
    assert not has_state_protocol(stream.shuffle(seed=1, buffer_size=4))  # datasets #7901: the buffer is lost


@pytest.mark.skipif(importlib.util.find_spec("datasets") is None, reason="needs datasets (.[streaming])")
def test_a_hugging_face_stream_drawing_in_its_pipeline_resumes_with_the_same_draws():
    from datasets import Dataset

    threads = set()

    def noise(example):  # datasets runs a pipeline's functions in the threads that read its shards
        threads.add(threading.get_ident())
        return {"id": example["id"], "noise": torch.randn(2).tolist()}

    stream = Dataset.from_dict({"id": list(range(24))}).to_iterable_dataset(num_shards=4)
    stream = stream.map(noise).shuffle(seed=1, buffer_size=4).with_format("torch")
    head, tail, again = resumed_batches(stream, 3)
    assert threads == {threading.get_ident()}  # read in turn: the draws come in the stream's order
    assert len(head) == 3 and len(tail) == 5
    for a, b in zip(tail, again, strict=True):
        assert torch.equal(a["id"], b["id"]) and torch.equal(a["noise"], b["noise"])


def test_the_state_protocol_needs_both_methods():
    class Half(IterableDataset):
        def __iter__(self):
            return iter(())

        def state_dict(self):
            return {}

    class Both(Half):
        def load_state_dict(self, state):
            pass

    assert not has_state_protocol(Half()) and has_state_protocol(Both())


def test_per_sample_seeding_is_refused_for_a_stream_with_the_reason():
    from lightning_determinism.data.worker_seeding import LoaderSeeding

    loader = DataLoader(Noisy(), batch_size=2)
    with pytest.warns(DeterminismWarning, match="has no meaning for `Noisy`, a stream"):
        LoaderSeeding(base_seed=1, rank=0, per_sample=True).prepare(loader, "train")
    assert not hasattr(loader.dataset, "__getitems__")


def resumed_elsewhere(dataset, k: int, **loader):
    """The uninterrupted epoch (batches of 3, no workers) and its rest after batch ``k`` on another grid."""
    uninterrupted = make_resumable(DataLoader(dataset, batch_size=3), None)
    iterator = iter(uninterrupted)
    head = [next(iterator) for _ in range(k)]
    position = uninterrupted._ldet_position.at(k)
    tail = list(iterator)
    resumed = make_resumable(DataLoader(dataset, **loader), None)
    setattr(resumed, PLAN_ATTR, {"epoch": 0, "stream": position, "grid": [position]})
    with pytest.warns(DeterminismWarning, match=r"resumes on another grid \(num_workers 0 -> 2, batch_size 3 -> 4\)"):
        again = list(resumed)
    return head, tail, again


def samples(batches) -> dict[int, torch.Tensor]:
    return {int(i): noise for batch in batches for i, noise in zip(batch["id"], batch["noise"], strict=True)}


def test_a_stream_resumed_with_other_workers_and_batch_size_trains_the_rest_once_bit_for_bit():
    head, tail, again = resumed_elsewhere(Noisy(), 3, batch_size=4, num_workers=2)
    rest, elsewhere = samples(tail), samples(again)
    assert sum(len(batch["id"]) for batch in again) == len(elsewhere) == 24 - 9  # none repeated
    assert set(elsewhere) == set(rest) and set(rest).isdisjoint(samples(head))  # none skipped
    assert all(torch.equal(elsewhere[i], rest[i]) for i in rest)  # the noise drawn in the stream, bit for bit
    assert [len(batch["id"]) for batch in again] == [4, 4, 4, 3]


def test_a_position_without_the_other_ranks_restarts_the_epoch_with_a_warning():
    uninterrupted = make_resumable(DataLoader(Noisy(), batch_size=3), None)
    iterator = iter(uninterrupted)
    [next(iterator) for _ in range(2)]
    resumed = make_resumable(DataLoader(Noisy(), batch_size=3, num_workers=1), None)
    setattr(resumed, PLAN_ATTR, {"epoch": 0, "stream": uninterrupted._ldet_position.at(2)})
    with pytest.warns(DeterminismWarning, match="no position of the other ranks: the interrupted epoch .* restarts"):
        assert len(samples(resumed)) == 24


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("batch", [1, 2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_the_rest_of_an_epoch_is_dealt_to_ranks_and_workers_with_as_many_batches_on_every_rank(world, batch, drop_last):
    """Every item once; every rank the same number of batches; an item repeated only when no split can do without."""
    for count in range(0, 3 * world * batch + 2):
        per_rank = []
        for rank in range(world):
            dealt = []
            for worker in range(2):
                checks = Checks()
                own = list(share(iter(range(count)), rank, Layout(world, 2, batch, drop_last), worker, checks))
                dealt.append([own[i : i + batch] for i in range(0, len(own), batch)])
            batches = [b for pair in itertools.zip_longest(*dealt) for b in pair if b]  # PyTorch's round-robin
            per_rank.append([b for b in batches if len(b) == batch or not drop_last])
        assert len({len(batches) for batches in per_rank}) == 1
        taken = [i for batches in per_rank for b in batches for i in b]
        impossible = count % world and (count // world) % batch == 0  # one rank more would open a batch alone
        if drop_last:
            assert len(taken) == len(set(taken)) and len(taken) >= count - count % world - world * (batch - 1)
        elif impossible:
            assert set(taken) == set(range(count)) and len(taken) == count + world - count % world
        else:
            assert sorted(taken) == list(range(count))


def test_an_old_stream_runs_with_the_identity_it_had():
    seen = []

    class Reporter(IterableDataset):
        def __iter__(self):
            info = torch.utils.data.get_worker_info()
            seen.append((dist.get_rank(), dist.get_world_size(), os.environ["RANK"], info.id, info.num_workers))
            yield torch.rand(())

    positions = [{"workers": 3, "num_workers": 3, "items": [0, 0, 0], "digests": [0] * 3, "states": [None] * 3}] * 2
    stream = OldStream(Reporter(), 5, 0, Grid(positions), 1, 2)
    assert torch.equal(next(stream), next(OldStream(Reporter(), 5, 0, Grid(positions), 1, 2)))  # its own seed
    assert seen[0] == (1, 2, "1", 2, 3) and torch.utils.data.get_worker_info() is None and not dist.is_initialized()


@pytest.mark.filterwarnings("ignore:.*resumes on another grid:lightning_determinism.errors.DeterminismWarning")
def test_a_rank_that_would_have_one_batch_fewer_repeats_a_sample_and_says_so(monkeypatch):
    """9 samples left, 2 ranks, batches of 2: 4 each, then one more opens a third batch on rank 0 only."""
    import lightning_determinism.data.stream_loader as stream_loader
    from lightning_determinism.data.stream_state import IsolatedStreams
    from lightning_determinism.data.streams import StreamPlan

    uninterrupted = make_resumable(DataLoader(Noisy(), batch_size=3), None)
    iterator = iter(uninterrupted)
    [next(iterator) for _ in range(5)]
    position = uninterrupted._ldet_position.at(5)
    rest = [int(i) for batch in iterator for i in batch["id"]]
    monkeypatch.setattr(stream_loader, "_world", lambda trainer: 2)
    resumed = make_resumable(DataLoader(Noisy(), batch_size=2), None)
    resumed._ldet_stream_plan, resumed._ldet_isolated = StreamPlan(0, rank=1), IsolatedStreams()  # rank 1 of 2
    setattr(resumed, PLAN_ATTR, {"epoch": 0, "stream": position, "grid": [position]})
    with pytest.warns(DeterminismWarning, match="this rank repeats 1 of them"):
        got = [[int(i) for i in batch["id"]] for batch in resumed]
    assert len(rest) == 9 and got == [[rest[1], rest[3]], [rest[5], rest[7]], [rest[8]]]  # rank 0 has rest[8] too


def test_a_litdata_drop_last_other_than_the_checkpoints_is_refused_at_resume_in_one_line():
    from lightning_determinism._compat.data import litdata_state_for

    loader = SimpleNamespace(dataset=SimpleNamespace(drop_last=False), num_workers=2, batch_size=4)
    state = {"dataset": {"drop_last": True, "world_size": 1, "initial_world_size": 1, "sample_in_epoch": 8}}
    said = r"^\[rank: 0\] `drop_last` .* is False, .* planned with True on 1 rank\(s\)"
    with pytest.raises(ValueError, match=said) as error:
        litdata_state_for(loader, state)  # one process, True given when it was written: not litdata's default
    assert "\n" not in str(error.value) and "create it with `drop_last=True`" in str(error.value)
    assert litdata_state_for(SimpleNamespace(**{**vars(loader), "dataset": SimpleNamespace(drop_last=True)}), state)


@pytest.mark.skipif(importlib.util.find_spec("litdata") is None, reason="needs litdata (docs/streaming.md)")
def test_litdata_default_drop_last_resumes_on_another_world_size_and_deals_the_whole_rest():
    import litdata.streaming.dataset as litdata_dataset

    from lightning_determinism._compat.data import litdata_exact_restripe, litdata_state_for
    from lightning_determinism.data.elastic_streams import exact_plans

    # Written on 2 ranks with the default (True), resumed on this one process (False): accepted.
    loader = SimpleNamespace(dataset=SimpleNamespace(drop_last=False), num_workers=2, batch_size=4)
    state = {"dataset": {"drop_last": True, "world_size": 2, "initial_world_size": 2, "sample_in_epoch": 24}}
    assert litdata_state_for(loader, state)["dataset"]["drop_last"] is True  # the epoch stays planned with it
    # 1 rank -> 2 x 2 workers after 8 of 64 samples: litdata's planner kept 48 of the 56 left (drop_last).
    assert litdata_exact_restripe(exact_plans)
    stream = [(i // 8, i) for i in range(64)]
    grid = {"world_size": 2, "num_workers": 2, "batch_size": 4}
    plans = litdata_dataset.restripe_items(stream, **grid, drop_first=8, drop_last=True)
    assert sorted(item for plan in plans for _, items in plan for item in items) == list(range(8, 64))
