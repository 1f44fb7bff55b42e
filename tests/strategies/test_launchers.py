"""The deterministic launchers: a forked rank does not hang in OpenMP, and no rank outlives the main process."""

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import child_env, warm

pytestmark = [pytest.mark.distributed, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")]

SCRIPT = Path(__file__).parents[1] / "helpers" / "scripts" / "launch_checks.py"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "State:\tZ" not in state  # a zombie is dead, only not yet reaped


def _wait_for(paths, timeout):
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True  # the script writes each file whole (rename), so one that exists can be read


@pytest.mark.parametrize(("mode", "ranks"), [("fork", 1), ("popen", 2)])
def test_ranks_die_with_the_main_process(tmp_path, mode, ranks):
    # The main process forked from the warm interpreter (tests/helpers/warm.py); the popen rank it starts is cold.
    env = child_env(OMP_NUM_THREADS="2") if mode == "fork" else child_env()
    proc = warm.start([sys.executable, str(SCRIPT), mode, str(tmp_path)], env=env, merge_stderr=True)
    try:
        pid_files = [tmp_path / f"rank{r}.pid" for r in range(ranks)]
        # For fork: the rank got through a multi-threaded forward after the parent had used OpenMP (no hang).
        if not _wait_for(pid_files, timeout=240):
            proc.kill()
            pytest.fail(f"the ranks never reached their first step:\n{proc.communicate(timeout=30)[0][-3000:]}")
        rank_pids = [int(p.read_text()) for p in pid_files]
        main_pid = int((tmp_path / "main.pid").read_text())
        assert main_pid == proc.pid
        children = [pid for pid in rank_pids if pid != main_pid]
        assert children and all(_alive(pid) for pid in children)
        os.kill(main_pid, signal.SIGKILL)  # an external kill: no handler runs in the main process
        proc.wait(timeout=30)
        deadline = time.monotonic() + 20
        while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(pid) for pid in children), "a rank outlived the main process"
        if mode == "fork":
            assert "each forked rank runs with one intra-op thread" in proc.communicate(timeout=30)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid_file in tmp_path.glob("rank*.pid"):
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
