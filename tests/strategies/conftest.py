"""Fixtures shared by the model-parallel strategy tests (one process, Fabric, torchrun nodes)."""

import json
import sys

import pytest

from tests.helpers import CHILD_TIMEOUT_S, child_env, warm
from tests.strategies import test_model_parallel_strategy as model_parallel


@pytest.fixture(scope="session")
def model_parallel_runs(tmp_path_factory):
    """test_model_parallel_strategy.py's runs, three child processes side by side: the configurations, a Fabric loop,
    and the mixin's rule before it followed the mesh (base + rank everywhere), for the replica guard. test_multinode.py
    compares its torchrun nodes with dp2tp2's straight run."""
    root = tmp_path_factory.mktemp("model-parallel")
    (root / "fabric").mkdir()
    old_config = json.dumps([{"name": "old", "dp": 1, "tp": 2}])
    # The Fabric loop's popen rank (its launcher runs the script again) forks from the warm interpreter too (nested):
    # the popen path's own tests start it cold (test_fabric_dist.py, test_launchers.py).
    commands = {
        "main": ([str(model_parallel.SCRIPT), str(root), json.dumps(model_parallel.CONFIGS)], {}, False),
        "fabric": ([str(model_parallel.FABRIC), str(root / "fabric")], {}, True),
        "old": ([str(model_parallel.SCRIPT), str(root / "old"), old_config], {"GUARD": "off"}, False),
    }
    procs = {
        name: warm.start([sys.executable, *args], env=child_env(**env), merge_stderr=True, nested=nested)
        for name, (args, env, nested) in commands.items()
    }
    done = {name: (proc.communicate(timeout=CHILD_TIMEOUT_S)[0], proc.returncode) for name, proc in procs.items()}
    for name in ("main", "fabric"):
        assert done[name][1] == 0, f"{name}: " + done[name][0][-5000:]
    return root, done["old"]
