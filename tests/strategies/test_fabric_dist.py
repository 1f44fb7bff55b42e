"""Fabric on two gloo ranks (the user's script re-run by the popen launcher): the seeding contract."""

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers import CHILD_TIMEOUT_S, child_env, env_without, warm

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).parents[1] / "helpers" / "scripts" / "fabric_ranks.py"


def test_two_fabric_ranks_build_the_same_weights_then_draw_apart(tmp_path):
    env = {**env_without("PL_GLOBAL_SEED"), "MASTER_PORT": child_env()["MASTER_PORT"]}
    process = warm.start([sys.executable, str(SCRIPT), str(tmp_path)], env=env)
    out, err = process.communicate(timeout=CHILD_TIMEOUT_S)
    assert process.returncode == 0, err[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["strategy"] == "DeterministicFabricDDPStrategy"
    base = ranks[0]["base"]
    assert ranks[1]["base"] == base  # drawn on rank 0, broadcast
    assert [r["local"] for r in ranks] == [base, base + 1]
    torch.manual_seed(base)  # the reference: one process, seeded by hand with the base seed
    first, second = nn.Linear(8, 8), nn.Linear(8, 8)
    for rank in ranks:
        assert rank["before"] == first.weight.tolist() and rank["inside"] == second.weight.tolist()
    for r, rank in enumerate(ranks):
        assert rank["draw"] == (torch.manual_seed(base + r), torch.rand(4))[1].tolist()
    assert ranks[0]["draw"] != ranks[1]["draw"]
    assert f"Seed set to {base} by lightning_determinism (drawn on rank 0" in err + out
    for r in (0, 1):  # rank 0 is the user's process: nothing of the run's seed is left in it (nor in rank 1)
        left = json.loads((tmp_path / f"after{r}.json").read_text())
        assert left == {"PL_GLOBAL_SEED": None, "LDET_BASE_SEED": None, "LDET_LOCAL_SEED": None}
