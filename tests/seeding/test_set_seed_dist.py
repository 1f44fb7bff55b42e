"""set_seed on 2 gloo ranks: the broadcast, the offset, the range (fast forked ranks)."""

import json
import random

import numpy as np
import pytest
import torch

from lightning_determinism import set_seed
from lightning_determinism.seeding.seeds import current_seeds
from tests.helpers import run_distributed
from tests.helpers.lightning_models import draws, reference_draws

pytestmark = pytest.mark.distributed


def _perturb(rank: int) -> None:
    # Forked ranks inherit the parent's RNG: give each its own state so agreement can't be inherited.
    random.seed(1000 + rank)
    np.random.seed(1000 + rank)
    torch.manual_seed(1000 + rank)


def _seed_and_record(rank, world_size, seed, out_dir):
    _perturb(rank)
    base = set_seed(seed)
    record = {"base": base, "draws": draws(), "seeds": current_seeds()}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(record))


def _records(out_dir, world_size=2):
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]


def test_explicit_seed_is_offset_by_rank(tmp_path):
    torch.manual_seed(5)  # the parent's state must not matter
    run_distributed(_seed_and_record, tmp_path, 42, tmp_path)
    records = _records(tmp_path)
    for rank, record in enumerate(records):
        assert record["base"] == 42
        assert record["draws"] == reference_draws(42 + rank)
        assert record["seeds"] == {"base_seed": 42, "local_seed": 42 + rank}
    assert records[0]["draws"] != records[1]["draws"]


def test_none_is_drawn_on_rank_zero_and_broadcast(tmp_path):
    bases = []
    for attempt in range(2):
        out = tmp_path / str(attempt)
        out.mkdir()
        run_distributed(_seed_and_record, tmp_path, None, out)
        records = _records(out)
        assert records[0]["base"] == records[1]["base"]
        for rank, record in enumerate(records):
            assert record["draws"] == reference_draws(record["base"] + rank)
        bases.append(records[0]["base"])
    assert bases[0] != bases[1]  # fresh entropy each run (equal with probability 2**-32)
    assert all(0 <= b <= 2**32 - 2 for b in bases)


def _top_seed_must_fail(rank, world_size):
    with pytest.raises(ValueError, match=r"`seed` must be in \[0, 4294967294\] for world_size=2, got 4294967295"):
        set_seed(2**32 - 1)
    assert set_seed(2**32 - 2) == 2**32 - 2
    assert draws() == reference_draws(2**32 - 2 + rank)


def test_range_shrinks_with_world_size(tmp_path):
    run_distributed(_top_seed_must_fail, tmp_path)


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise KeyError("the real failure")
    torch.distributed.barrier()  # rank 0 then dies of a connection error


def test_helper_reports_the_earliest_failure(tmp_path):
    with pytest.raises(AssertionError, match="the real failure"):
        run_distributed(_fail_on_rank_one, tmp_path)
