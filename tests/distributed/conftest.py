"""Fixtures shared by several multi-process test modules."""

import json
import sys

import pytest

from tests import warm
from tests.distributed import test_model_parallel_strategy as model_parallel
from tests.distributed.test_resume import CONFIGS, SCRIPT
from tests.helpers import CHILD_TIMEOUT_S, child_env


@pytest.fixture(scope="session")
def resume_runs(tmp_path_factory):
    """test_resume.py's uninterrupted runs and their resumes (test_faults.py compares with them too)."""
    root = tmp_path_factory.mktemp("resume")
    # One process per configuration (the straight run, then the resumes), two configurations at a time: a phase spends
    # much of its time starting processes and waiting on rendezvous, which the other one's work fills.
    pending = list(CONFIGS.items())
    running: list[tuple[str, warm.Process]] = []
    while pending or running:
        while pending and len(running) < 2:
            name, (env, steps) = pending.pop(0)
            command = [sys.executable, str(SCRIPT), "both", str(root / name), *map(str, steps)]
            process = warm.start(command, env=child_env(**env))
            running.append((name, process))
        name, process = running.pop(0)
        out, err = process.communicate(timeout=CHILD_TIMEOUT_S)
        assert process.returncode == 0, f"{name}: " + out[-3000:] + err[-5000:]
    return root


@pytest.fixture(scope="session")
def model_parallel_runs(tmp_path_factory):
    """test_model_parallel_strategy.py's runs, three child processes side by side: the configurations, a Fabric loop,
    and the mixin's rule before it followed the mesh (base + rank everywhere), for the replica guard. test_multinode.py
    compares its torchrun nodes with dp2tp2's straight run."""
    root = tmp_path_factory.mktemp("model-parallel")
    (root / "fabric").mkdir()
    old_config = json.dumps([{"name": "old", "dp": 1, "tp": 2}])
    commands = {
        "main": ([str(model_parallel.SCRIPT), str(root), json.dumps(model_parallel.CONFIGS)], {}),
        "fabric": ([str(model_parallel.FABRIC), str(root / "fabric")], {}),
        "old": ([str(model_parallel.SCRIPT), str(root / "old"), old_config], {"GUARD": "off"}),
    }
    procs = {
        name: warm.start([sys.executable, *args], env=child_env(**env), merge_stderr=True)
        for name, (args, env) in commands.items()
    }
    done = {name: (proc.communicate(timeout=CHILD_TIMEOUT_S)[0], proc.returncode) for name, proc in procs.items()}
    for name in ("main", "fabric"):
        assert done[name][1] == 0, f"{name}: " + done[name][0][-5000:]
    return root, done["old"]
