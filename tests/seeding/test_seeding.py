import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from lightning_determinism import derive_seed, set_seed
from lightning_determinism.seeding.seeds import check_seed, current_seeds, resolve_base_seed
from tests.helpers import CHILD_TIMEOUT_S, child_env, warm
from tests.helpers.lightning_models import draws, reference_draws

HI = 2**32 - 1


@pytest.mark.parametrize(
    ("seed", "world_size"),
    [(0, 1), (HI, 1), (HI - 1, 2), (12345, 2), (np.int64(7), 1), (np.uint32(HI), 1), (HI - 63, 64)],
)
def test_check_seed_accepts_the_torchtune_range(seed, world_size):
    value = check_seed(seed, world_size)
    assert type(value) is int
    assert value == int(seed)


@pytest.mark.parametrize(
    ("seed", "world_size", "hi"), [(-1, 1, HI), (HI + 1, 1, HI), (HI, 2, HI - 1), (HI - 2, 4, HI - 3)]
)
def test_check_seed_rejects_out_of_range_with_range_and_value(seed, world_size, hi):
    with pytest.raises(ValueError, match=rf"`seed` must be in \[0, {hi}\] for world_size={world_size}, got {seed}"):
        check_seed(seed, world_size)


@pytest.mark.parametrize("seed", [1.0, True, "42", [1], np.float32(3)])
def test_check_seed_rejects_non_integers(seed):
    with pytest.raises(TypeError, match=r"`seed` must be an int in \[0, 4294967295\], got"):
        check_seed(seed)


@pytest.mark.parametrize("seed", [-5, HI + 1, 2.5, False])
def test_set_seed_validates_before_touching_any_rng(seed):
    before = torch.get_rng_state()
    with pytest.raises((TypeError, ValueError), match="`seed`"):
        set_seed(seed)
    assert torch.equal(before, torch.get_rng_state())


@pytest.mark.parametrize("seed", [0, 42, HI])
def test_set_seed_seeds_python_numpy_torch_with_seed_plus_rank_zero(seed):
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)  # perturb first: the result must come from `seed`, not from what was there
    assert set_seed(seed) == seed
    assert draws() == reference_draws(seed)
    assert current_seeds() == {"base_seed": seed, "local_seed": seed}


def test_set_seed_none_draws_from_os_entropy_not_from_torch():
    torch.manual_seed(0)
    first = set_seed(None)
    torch.manual_seed(0)
    second = set_seed(None)
    assert 0 <= first <= HI and 0 <= second <= HI
    assert first != second  # equal with probability 2**-32
    assert draws() == reference_draws(second)


def test_set_seed_none_touches_no_backend_flag():
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.deterministic = False
    torch.backends.cuda.matmul.allow_tf32 = True
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":0:0"
    set_seed(3, debug_mode=None)
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.benchmark is True
    assert torch.backends.cudnn.deterministic is False
    assert torch.backends.cuda.matmul.allow_tf32 is True
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":0:0"


@pytest.mark.parametrize(("mode", "warn_only"), [("warn", True), (1, True), ("error", False), (2, False)])
def test_set_seed_debug_mode_sets_backend_flags(mode, warn_only):
    set_seed(1, debug_mode=mode)
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.is_deterministic_algorithms_warn_only_enabled() is warn_only
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark


def test_set_seed_rejects_unknown_debug_mode_before_seeding():
    before = torch.get_rng_state()
    with pytest.raises(ValueError, match="`debug_mode` must be one of None, 'default', 'warn', 'error', 0, 1, 2"):
        set_seed(1, debug_mode="strict")
    assert torch.equal(before, torch.get_rng_state())


def test_resolve_base_seed_takes_pl_global_seed_only_when_asked(monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", "777")
    assert resolve_base_seed(None, rank=0, world_size=1, use_pl_global_seed=True) == 777
    assert resolve_base_seed(5, rank=0, world_size=1, use_pl_global_seed=True) == 5
    monkeypatch.setenv("PL_GLOBAL_SEED", "not-a-seed")
    with pytest.raises(ValueError, match="`PL_GLOBAL_SEED` must hold an int seed, got 'not-a-seed'"):
        resolve_base_seed(None, rank=0, world_size=1, use_pl_global_seed=True)


def test_derive_seed_is_deterministic_in_range_and_order_sensitive():
    seed = derive_seed(42, "worker", 3)
    assert seed == derive_seed(42, "worker", 3)
    assert 0 <= seed <= HI
    assert derive_seed(42, 3, "worker") != seed
    assert derive_seed(1, 1) != derive_seed(2, 0)  # where `base + offset` collides
    assert derive_seed(1) != derive_seed("1")  # ints and strings never meet
    assert derive_seed(2**40) != derive_seed(0, 2**8)


def test_derive_seed_has_no_collisions_over_a_grid():
    seeds = {
        derive_seed(base, rank, worker, epoch)
        for base in (0, 1, 2)
        for rank in range(8)
        for worker in range(8)
        for epoch in range(8)
    }
    assert len(seeds) == 3 * 8 * 8 * 8


def test_derive_seed_does_not_depend_on_the_python_hash_seed(tmp_path):
    script = tmp_path / "salted.py"
    script.write_text("import sys\nfrom lightning_determinism import derive_seed\n"
                      "print(sys.hash_info.hash_bits, hash('stream'), derive_seed(5, 'stream', 2**70))\n")  # fmt: skip
    # Another interpreter with another salt: the warm one (tests/helpers/warm.py) where its salt differs from this
    # process's (random unless PYTHONHASHSEED is set), else a cold one with a fixed salt other than ours.
    child = warm.start([sys.executable, str(script)], env=child_env())
    out, err = child.communicate(timeout=CHILD_TIMEOUT_S)
    if int(out.split()[1]) == hash("stream"):
        salt = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
        child = subprocess.Popen([sys.executable, str(script)], env=child_env(PYTHONHASHSEED=salt),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        out, err = child.communicate(timeout=CHILD_TIMEOUT_S)
    assert child.returncode == 0, err[-3000:]
    _, their_hash, their_seed = out.split()
    assert int(their_hash) != hash("stream")  # the two salts differ: a salted hash() would show
    assert int(their_seed) == derive_seed(5, "stream", 2**70)


@pytest.mark.parametrize(
    ("keys", "error"),
    [((), ValueError), ((-1,), ValueError), ((1.5,), TypeError), ((True,), TypeError), ((None,), TypeError)],
)
def test_derive_seed_rejects_bad_keys(keys, error):
    with pytest.raises(error, match="derive_seed"):
        derive_seed(*keys)


def test_derive_seed_accepts_numpy_integers():
    assert derive_seed(np.int64(4), np.uint8(2)) == derive_seed(4, 2)


# Seeds of existing runs must never move: values of numpy.random.SeedSequence(words).generate_state(1)[0], which
# derive_seed returned before it hashed the words itself (computed with numpy 2.4, the reference implementation).
PINNED = [
    ((0,), 3964924996),
    ((42,), 3352027439),
    (("worker",), 4244869237),
    ((42, "worker", 0), 118100873),
    ((42, "worker", 1, 3), 3641821691),
    ((7, "micro-batch", 0, 0), 3090765729),
    ((7, "micro-batch", 123, 15), 2092434824),
    ((2**32,), 1709609553),
    ((2**40, "sample", 5), 1263737178),
    ((1, 1), 680546637),
    ((2, 0), 3889686692),
    ((42, "evaluation", "validate", 0, 10, 1), 1636635077),
]


@pytest.mark.parametrize(("keys", "seed"), PINNED, ids=[repr(k) for k, _ in PINNED])
def test_derive_seed_values_are_pinned(keys, seed):
    assert derive_seed(*keys) == seed
    assert derive_seed(*keys) == seed  # the second call takes the cached prefix


def test_derive_seed_equals_numpy_seed_sequence_over_random_keys():
    from lightning_determinism.seeding.seeds import _key_words

    rng = random.Random(0)
    for _ in range(500):
        keys = [
            rng.choice([rng.randrange(2 ** rng.choice([1, 8, 31, 32, 33, 64])), rng.choice(["", "a", "worker", "é"])])
            for _ in range(rng.randint(1, 6))
        ]
        words = [w for key in keys for w in _key_words(key)]
        assert derive_seed(*keys) == int(np.random.SeedSequence(words).generate_state(1, dtype=np.uint32)[0]), keys


def test_derive_seed_does_not_take_true_for_one_from_its_cache():
    derive_seed(5, 1)  # fills the cache for the prefix (5,)
    with pytest.raises(TypeError, match="got the bool True"):
        derive_seed(5, True)
    with pytest.raises(TypeError, match="got the bool True"):
        derive_seed(True, 1)


def test_the_invariant_modes_micro_batch_seeds_equal_numpy_over_random_steps():
    # The invariant mode keeps one step's hash state between its micro-batches (StepSeeds); every value must be
    # numpy's SeedSequence of the same words, as derive_seed's are (PINNED holds two of them).
    from lightning_determinism.seeding.seeds import StepSeeds, _key_words

    rng = random.Random(1)
    for base in (7, 0, 2**33, rng.randrange(2**32)):
        seeds = StepSeeds(base, "micro-batch")
        for _ in range(60):
            step = rng.choice([rng.randrange(50), rng.randrange(2**32), 2**32 + rng.randrange(9)])  # past a word too
            for j in sorted(rng.sample(range(64), 3)) + [2**32]:
                words = [w for key in (base, "micro-batch", step, j) for w in _key_words(key)]
                expected = int(np.random.SeedSequence(words).generate_state(1, dtype=np.uint32)[0])
                assert seeds(step, j) == expected, (base, step, j)
    assert StepSeeds(7, "micro-batch")(123, 15) == 2092434824  # PINNED
    prepared = StepSeeds(7, "micro-batch")
    prepared.prepare(123)
    assert prepared(123, 15) == 2092434824
    prepared.prepare(500)  # a step that does not come next: not used
    assert prepared(124, 0) == derive_seed(7, "micro-batch", 124, 0)
    # The invariant mode's strategy holds one, and spawn launchers pickle the strategy.
    import pickle

    prepared.prepare(125)
    copy = pickle.loads(pickle.dumps(prepared))
    assert copy(125, 3) == prepared(125, 3) == derive_seed(7, "micro-batch", 125, 3)
