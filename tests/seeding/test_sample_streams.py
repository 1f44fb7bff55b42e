"""sample_streams(): one generator per sample keyed by its dataset index and the pass, never by batch or rank."""

import numpy as np
import pytest
import torch

from lightning_determinism import SampleStreams, derive_seed, evaluation_streams, sample_seed, sample_streams
from lightning_determinism.seeding import isolation


def test_a_samples_seed_is_hashed_from_the_pass_and_its_index():
    # An independent reference: numpy's SeedSequence over the keys, as derive_seed documents.
    assert sample_seed(5, 3, "predict", 1, 2, 0) == derive_seed(5, "sample", "predict", 1, 2, 0, 3)
    seeds = {sample_seed(5, index, "predict", 1, 2) for index in range(1000)}
    assert len(seeds) == 1000
    assert sample_seed(5, 3, "predict", 1, 2) != sample_seed(5, 3, "validate", 1, 2)
    assert sample_seed(5, 3, "predict", 1, 2) != sample_seed(5, 3, "predict", 1, 2, call=1)


def test_each_sample_draws_the_same_numbers_in_any_batch_and_position():
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(8, 50), dim=-1)
    with sample_streams(list(range(8)), base_seed=1) as streams:
        together = torch.cat([streams.multinomial(probs) for _ in range(5)], dim=1)
        noise = streams.randn(3)
    order = [5, 2, 7]
    with sample_streams(order, base_seed=1) as streams:
        shuffled = torch.cat([streams.multinomial(probs[order]) for _ in range(5)], dim=1)
        assert torch.equal(streams.randn(3), noise[order])
    assert torch.equal(shuffled, together[order])
    # the global generator is not touched
    state = torch.get_rng_state()
    with sample_streams([0], base_seed=1) as streams:
        streams.rand(4)
    assert torch.equal(torch.get_rng_state(), state)


def test_the_draws_follow_the_samples_generator():
    # Reference: a generator seeded by hand from sample_seed, drawing the same sequence of calls.
    probs = torch.tensor([[0.1, 0.2, 0.7]])
    with sample_streams([42], base_seed=9, stage="predict", epoch=0, step=3) as streams:
        drawn = streams.multinomial(probs, num_samples=2)
        uniform = streams.rand(4)
    gen = torch.Generator().manual_seed(sample_seed(9, 42, "predict", 0, 3))
    assert torch.equal(drawn[0], torch.multinomial(probs[0], 2, generator=gen))
    assert torch.equal(uniform[0], torch.rand(4, generator=gen))


def test_monte_carlo_dropout_masks_are_per_sample():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Dropout(0.5), torch.nn.Linear(32, 2)).train()
    x = torch.randn(5, 6)
    with torch.no_grad(), sample_streams([10, 11, 12, 13, 14], base_seed=2):
        together = net(x)
    with torch.no_grad(), sample_streams([12], base_seed=2):
        alone = net(x[2:3])
    assert torch.allclose(alone[0], together[2], atol=1e-6)
    with torch.no_grad(), sample_streams([13], base_seed=2):  # another sample: another mask
        other = net(x[2:3])
    assert not torch.allclose(other[0], together[2])
    # the mask is inverted dropout's: zeros, or the input over 1 - p
    with sample_streams([0, 1], base_seed=2) as streams:
        out = streams.dropout(torch.ones(2, 1000), p=0.25)
    assert set(np.unique(out.numpy()).tolist()) <= {0.0, float(np.float32(1 / 0.75))}
    assert 0.2 < (out == 0).float().mean().item() < 0.3


def test_inside_an_evaluation_pass_the_pass_keys_the_streams(monkeypatch):
    monkeypatch.setattr(isolation, "_CALLS", {})
    with evaluation_streams("predict", epoch=2, step=8, base_seed=4, rank=1, call=1):
        with sample_streams([3]) as streams:
            assert streams.seeds == [sample_seed(4, 3, "predict", 2, 8, call=1)]
    assert SampleStreams([1, 2]).seeds == [1, 2]


@pytest.mark.parametrize(
    ("indices", "error", "match"),
    [
        ([1, -2], ValueError, r"dataset indices \(>= 0\), got -2"),
        ([1.0], TypeError, r"must hold ints"),
        (torch.zeros(2, 2, dtype=torch.long), TypeError, r"1-d integer tensor"),
        ("01", TypeError, r"got str"),
    ],
)
def test_bad_indices_are_refused(indices, error, match):
    with pytest.raises(error, match=match), sample_streams(indices, base_seed=0):
        pass


def test_a_batch_of_another_size_is_refused():
    with sample_streams([0, 1], base_seed=0) as streams:
        with pytest.raises(ValueError, match=r"one row per sample \(2\), got shape \(3, 4\)"):
            streams.multinomial(torch.ones(3, 4))
        with pytest.raises(ValueError, match=r"`p` must be in \[0, 1\], got 1.5"):
            streams.dropout(torch.ones(2, 3), p=1.5)


def test_without_a_base_seed_it_says_how_to_get_one(monkeypatch):
    from lightning_determinism.seeding import sample_streams as module

    monkeypatch.setattr(module, "current_seeds", lambda: {"base_seed": None})
    with pytest.raises(RuntimeError, match="needs the run's base seed"), sample_streams([0]):
        pass
