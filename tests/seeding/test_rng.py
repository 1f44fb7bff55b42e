"""RNG capture/restore, RNGStatesTracker semantics and isolated generators (one process)."""

import random

import numpy as np
import pytest
import torch

import lightning_determinism.seeding.generators as generators_module
from lightning_determinism import set_seed
from lightning_determinism.seeding.rng import (
    RNGStatesTracker,
    capture_rng_state,
    generator,
    get_rng_tracker,
    restore_rng_state,
)
from tests.helpers import requires_cuda
from tests.helpers.lightning_models import draws


@pytest.fixture(autouse=True)
def _clean_tracker_and_generators():
    saved_states, saved_gens = get_rng_tracker().get_states(), dict(generators_module._GENERATORS)
    get_rng_tracker().reset()
    generators_module._GENERATORS.clear()
    yield
    get_rng_tracker().set_states(saved_states)
    generators_module._GENERATORS.clear()
    generators_module._GENERATORS.update(saved_gens)


def ref(seed, n=3):
    return torch.rand(n, generator=torch.Generator().manual_seed(seed))


def test_add_does_not_disturb_the_caller():
    torch.manual_seed(5)
    tracker = RNGStatesTracker()
    tracker.add("a", 1)
    assert torch.equal(torch.rand(3), ref(5))


def test_duplicate_name_or_seed_is_refused():
    tracker = RNGStatesTracker()
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="RNG stream 'a' is already tracked"):
        tracker.add("a", 2)
    with pytest.raises(ValueError, match="seed 1 of RNG stream 'b' is already used by stream 'a'"):
        tracker.add("b", 1)
    with pytest.raises(ValueError, match="`seed`"):
        tracker.add("c", -3)
    with pytest.raises(TypeError, match="`name` must be a str"):
        tracker.add(3, 4)


def test_fork_switches_and_restores():
    tracker = RNGStatesTracker()
    tracker.add("model-parallel-rng", 42)
    torch.manual_seed(7)
    before = torch.rand(3)
    with tracker.fork():
        inside = torch.rand(3)
    after = torch.rand(3)
    expected_caller = torch.rand(6, generator=torch.Generator().manual_seed(7))
    assert torch.equal(torch.cat([before, after]), expected_caller)
    assert torch.equal(inside, ref(42))


def test_successive_forks_continue_the_stream():
    tracker = RNGStatesTracker()
    tracker.add("s", 9)
    with tracker.fork("s"):
        first = torch.rand(3)
    torch.rand(10)  # the caller draws in between
    with tracker.fork("s"):
        second = torch.rand(3)
    assert torch.equal(torch.cat([first, second]), ref(9, 6))


def test_nested_forks_equal_sequential_ones():
    def run(nested):
        tracker = RNGStatesTracker()
        tracker.add("a", 1)
        tracker.add("b", 2)
        torch.manual_seed(0)
        out = []
        if nested:
            with tracker.fork("a"):
                out.append(torch.rand(2))
                with tracker.fork("b"):
                    out.append(torch.rand(2))
                out.append(torch.rand(2))
        else:
            with tracker.fork("a"):
                out.append(torch.rand(2))
            with tracker.fork("b"):
                out.append(torch.rand(2))
            with tracker.fork("a"):
                out.append(torch.rand(2))
        out.append(torch.rand(2))  # the caller's stream afterwards
        return torch.cat(out)

    assert torch.equal(run(True), run(False))


def test_forking_the_active_stream_again_does_not_replay_it():
    tracker = RNGStatesTracker()
    tracker.add("a", 3)
    with tracker.fork("a"):
        x = torch.rand(2)
        with tracker.fork("a"):
            y = torch.rand(2)
    assert torch.equal(torch.cat([x, y]), ref(3, 4))


def test_unknown_stream_says_what_to_do():
    with pytest.raises(RuntimeError, match=r"'nope' is not tracked; register it with `get_rng_tracker\(\).add"):
        with RNGStatesTracker().fork("nope"):
            pass


def test_states_round_trip_and_continue(tmp_path):
    tracker = RNGStatesTracker()
    tracker.add("a", 11)
    with tracker.fork("a"):
        torch.rand(5)
    path = tmp_path / "tracker.pt"
    torch.save(tracker.get_states(), path)
    with tracker.fork("a"):
        expected = torch.rand(3)
    other = RNGStatesTracker()
    other.set_states(torch.load(path, weights_only=True))
    with other.fork("a"):
        got = torch.rand(3)
    assert torch.equal(got, expected)
    assert other.seeds == {"a": 11}
    with pytest.raises(ValueError, match=r"RNG stream 'a' misses \['seed'\]"):
        other.set_states({"a": {"cpu": torch.get_rng_state()}})


def test_a_fork_held_across_set_states_or_reset_follows_the_new_states():
    tracker = RNGStatesTracker()
    tracker.add("a", 11)
    held = tracker.fork("a")
    saved = tracker.get_states()
    with held:
        first = torch.rand(3)
    tracker.set_states(saved)  # back to before the draw
    with held:
        assert torch.equal(torch.rand(3), first)
    tracker.reset()
    with pytest.raises(RuntimeError, match="'a' is not tracked"):
        with held:
            pass
    tracker.add("a", 12)
    with held:
        assert torch.equal(torch.rand(3), torch.rand(3, generator=torch.Generator().manual_seed(12)))


def test_reset_forgets_streams():
    tracker = RNGStatesTracker()
    tracker.add("a", 1)
    tracker.reset()
    assert "a" not in tracker
    tracker.add("a", 1)  # allowed again


def test_capture_restore_every_stream_through_weights_only_load(tmp_path):
    set_seed(21)
    get_rng_tracker().add("t", 99)
    gen = generator("noise")
    random.random(), np.random.rand(), torch.rand(1), torch.rand(1, generator=gen), np.random.randn()  # has_gauss
    path = tmp_path / "rng.pt"
    torch.save(capture_rng_state(), path)
    expected = (draws(), torch.rand(2, generator=gen).tolist(), float(np.random.randn()))
    with get_rng_tracker().fork("t"):
        expected_tracker = torch.rand(2)
    set_seed(1)
    torch.rand(7, generator=gen)
    restore_rng_state(torch.load(path, weights_only=True))
    got = (draws(), torch.rand(2, generator=gen).tolist(), float(np.random.randn()))
    with get_rng_tracker().fork("t"):
        got_tracker = torch.rand(2)
    assert got == expected
    assert torch.equal(got_tracker, expected_tracker)


def test_restore_names_a_missing_key():
    state = capture_rng_state()
    del state["numpy"]
    with pytest.raises(KeyError, match="RNG state misses 'numpy'"):
        restore_rng_state(state)


def test_generator_is_cached_seeded_and_separate():
    set_seed(4)
    g = generator("actions")
    assert generator("actions") is g
    assert generator("noise") is not g
    a = torch.rand(3, generator=g)
    generators_module._GENERATORS.clear()
    set_seed(4)
    torch.rand(100)  # the global stream moving does not matter
    assert torch.equal(torch.rand(3, generator=generator("actions")), a)
    assert not torch.equal(torch.rand(3, generator=generator("noise")), a)


def test_generator_needs_a_base_seed(monkeypatch):
    monkeypatch.delenv("LDET_BASE_SEED", raising=False)
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    with pytest.raises(RuntimeError, match=r"generator\('x'\) needs a base seed"):
        generator("x")


@requires_cuda
def test_tracker_tracks_the_cuda_generator():
    tracker = RNGStatesTracker()
    tracker.add("a", 5)
    torch.cuda.manual_seed(1)
    before = torch.cuda.get_rng_state()
    with tracker.fork("a"):
        inside = torch.rand(3, device="cuda")
    assert torch.equal(torch.cuda.get_rng_state(), before)
    assert torch.equal(inside, torch.rand(3, device="cuda", generator=torch.Generator("cuda").manual_seed(5)))
