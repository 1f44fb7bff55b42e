"""DistributedMean over padded batches: the validation loss of docs/mean.md's recipe on batch sizes 1, 4 and 16 and on
1, 2 and 3 processes, against the exact mean of the real tokens' losses (fractions, one rounding).

Sequences of 1 to 8 tokens are padded to the longest of their batch with label -100, where
``cross_entropy(..., reduction="none")`` gives 0.0: counted, those zeros move the mean with the batch composition.
A token's logits come from a fixed table (the model's batch invariance is another matter: docs/mean.md).
"""

import json
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F

from lightning_determinism import DistributedMean
from tests.helpers import run_distributed

SAMPLES, VOCAB, PAD = 61, 33, -100


def _data() -> tuple[list[torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 9, (SAMPLES,), generator=gen).tolist()
    samples = [torch.randint(VOCAB, (n + 1,), generator=gen) for n in lengths]
    return samples, torch.randn(VOCAB, VOCAB, generator=gen) * 2


def _batches(indices: list[int], batch_size: int):
    samples, table = _data()
    for start in range(0, len(indices), batch_size):
        chosen = [samples[i] for i in indices[start : start + batch_size]]
        longest = max(len(s) for s in chosen) - 1
        inputs = torch.zeros(len(chosen), longest, dtype=torch.long)
        labels = torch.full((len(chosen), longest), PAD)
        for row, sample in enumerate(chosen):
            inputs[row, : len(sample) - 1], labels[row, : len(sample) - 1] = sample[:-1], sample[1:]
        yield table[inputs], labels


def _validation_loss(indices: list[int], batch_size: int, masked: bool = True) -> DistributedMean:
    """docs/mean.md's validation step: per-token losses, the padded ones masked out."""
    metric = DistributedMean()
    for logits, labels in _batches(indices, batch_size):
        per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
        metric.update(per_token, mask=labels.flatten() != PAD) if masked else metric.update(per_token)
    return metric


def _reference() -> tuple[float, int]:
    """The exact mean of every real token's loss, each sample's computed alone (no padding), rounded once."""
    samples, table = _data()
    losses = [F.cross_entropy(table[s[:-1]], s[1:], reduction="none") for s in samples]
    exact = [Fraction(float(v)) for loss in losses for v in loss]
    return float(sum(exact) / len(exact)), len(exact)


def test_padded_batches_of_1_4_and_16_give_the_exact_mean_of_the_real_tokens():
    reference, tokens = _reference()
    everything = list(range(SAMPLES))
    for batch_size in (1, 4, 16):
        metric = _validation_loss(everything, batch_size)
        assert float(metric.compute()) == reference and int(metric.count) == tokens, batch_size
    # Counting the padding (the recipe before) moves with the batch size: the check can fail
    counted = [float(_validation_loss(everything, bs, masked=False).compute()) for bs in (4, 16)]
    assert counted[0] != counted[1] and all(value < reference for value in counted)


def _shard(rank, world_size, out_dir):
    # UnpaddedDistributedSampler's share: rank, rank + W, ...; compute() syncs over the group (count stays local)
    metric = _validation_loss(list(range(rank, SAMPLES, world_size)), 4)
    (out_dir / f"rank{rank}.json").write_text(json.dumps([float(metric.compute()).hex(), int(metric.count)]))


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_padded_batches_on_2_and_3_processes_give_the_same_bits(tmp_path, world_size):
    reference, tokens = _reference()
    run_distributed(_shard, tmp_path, tmp_path, world_size=world_size)
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(world_size)]
    assert [value for value, _ in records] == [reference.hex()] * world_size
    assert sum(count for _, count in records) == tokens  # each process's own count: every real token once


def test_a_mask_must_be_bool_and_broadcast():
    metric = DistributedMean()
    with pytest.raises(TypeError, match=r"`mask` must be a bool tensor \(True: counted\), got a torch.int64 tensor"):
        metric.update(torch.ones(3), mask=torch.ones(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"`mask` of shape \(2,\) does not broadcast to `value` of shape \(3,\)"):
        metric.update(torch.ones(3), mask=torch.ones(2, dtype=torch.bool))
    # masked out: nothing of the element counts, not even a NaN; with a weight, the weight of the kept ones
    values, weights = torch.tensor([1.0, float("nan"), 3.0]), torch.tensor([1, 5, 2])
    metric.update(values, weight=weights, mask=torch.tensor([1, 0, 1]) > 0)
    assert float(metric.compute()) == 7.0 / 3 and int(metric.count) == 3
