"""Streams in one process: the batch order a resumed epoch restores, replay and its check, the state protocol."""

import importlib.util
import itertools
import random
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from lightning_determinism.data.positions import PLAN_ATTR
from lightning_determinism.data.resumable import make_resumable
from lightning_determinism.data.streams import StreamIterator, StreamPosition, Tagged, has_state_protocol
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
