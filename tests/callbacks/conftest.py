"""Fixtures shared by the resume and fault tests: the uninterrupted runs and their resumes."""

import sys

import pytest

from tests.callbacks.test_resume import CONFIGS, SCRIPT
from tests.helpers import CHILD_TIMEOUT_S, child_env, warm


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
