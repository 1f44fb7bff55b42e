"""The warm interpreter's children (tests/helpers/warm.py) behave as ``python script.py`` would, where tests rely on
it."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import CHILD_TIMEOUT_S, child_env, warm

pytestmark = pytest.mark.distributed  # it starts processes; the session starts the server early for these

SCRIPT = """
import atexit, json, os, random, sys
import numpy as np
import torch
atexit.register(lambda: print("atexit", flush=True))
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "mark": os.environ.get("MARK"),
                  "threads": torch.get_num_threads(), "random": random.random(), "numpy": float(np.random.rand()),
                  "own_group": os.getpgid(0) == os.getpid(), "pid": os.getpid()}))
print("on stderr", file=sys.stderr)
if os.environ.get("HOLD"):
    open(os.environ["HOLD"], "w").close()
    __import__("signal").pause()  # until the test's SIGTERM ends it
if os.environ.get("FAIL"):
    raise ValueError("failed on purpose")
sys.exit(int(os.environ.get("CODE", "0")))
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "scripts" / "child.py"
    path.parent.mkdir()
    path.write_text(SCRIPT)
    return path


def _facts(out: str) -> dict:
    return json.loads(out.splitlines()[0])


def test_a_child_gets_the_scripts_argv_directory_environment_streams_and_exit(script, tmp_path):
    env = child_env(MARK="7", OMP_NUM_THREADS="1", CODE="3")
    child = warm.start([sys.executable, str(script), "a", "b"], env=env, cwd=tmp_path)
    assert isinstance(child, warm.Child)
    out, err = child.communicate(timeout=CHILD_TIMEOUT_S)
    facts = _facts(out)
    assert child.returncode == 3 and out.splitlines()[-1] == "atexit" and err == "on stderr\n"
    assert facts["argv"] == [str(script), "a", "b"] and facts["cwd"] == str(tmp_path)
    assert facts["path0"] == str(script.parent) and facts["mark"] == "7" and facts["threads"] == 1
    assert not facts["own_group"]


def test_children_draw_fresh_entropy_as_cold_interpreters_do(script):
    outs = [warm.start([sys.executable, str(script)], env=child_env()).communicate(CHILD_TIMEOUT_S)[0] for _ in "ab"]
    first, second = map(_facts, outs)
    assert first["random"] != second["random"] and first["numpy"] != second["numpy"]


def test_an_exception_prints_its_traceback_and_exits_1(script):
    child = warm.start([sys.executable, str(script)], env=child_env(FAIL="1"), merge_stderr=True)
    out, err = child.communicate(timeout=CHILD_TIMEOUT_S)
    assert child.returncode == 1 and err is None
    assert "Traceback" in out and "ValueError: failed on purpose" in out


def test_a_child_in_its_own_session_is_signalled_as_a_group(script, tmp_path):
    held = tmp_path / "held"
    child = warm.start([sys.executable, str(script)], env=child_env(HOLD=str(held)), session=True)
    while not held.exists():  # the hand-shake: the child is past its print and waits for the signal
        assert child.poll() is None, child.communicate()
        time.sleep(0.01)
    os.killpg(child.pid, signal.SIGTERM)
    out, _ = child.communicate(timeout=CHILD_TIMEOUT_S)
    assert child.returncode == -signal.SIGTERM and _facts(out)["own_group"]


def test_what_a_cold_start_reads_gets_a_cold_start(script):
    child = warm.start([sys.executable, str(script)], env=child_env(TORCH_SHOW_CPP_STACKTRACES="1"))
    assert isinstance(child, subprocess.Popen)  # subprocess's own: stopped at once, its start is not ours to test
    child.kill()
    child.communicate(timeout=CHILD_TIMEOUT_S)


NESTED = """
import json, os, subprocess, sys
if sys.argv[1:] == ["inner"]:  # a child of the script below
    print(json.dumps({"warm": "lightning" in sys.modules, "ppid": os.getppid(), "line": sys.stdin.readline()}))
    sys.exit(int(os.environ.get("CODE", "0")))
me, inner = os.getpid(), [sys.executable, "-u", __file__, "inner"]
def ran(**env):
    return subprocess.run(inner, capture_output=True, text=True, input="", env={**os.environ, **env})
run, cold, other = ran(CODE="5"), ran(LDET_LAUNCHER_PID=str(me)), ran(TORCH_SHOW_CPP_STACKTRACES="1")
held = subprocess.Popen(inner, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
waiting = held.poll()  # the hand-shake: the child cannot end before it has read a line
try:
    held.wait(timeout=0.05)
    timed_out = False
except subprocess.TimeoutExpired:
    timed_out = True
out, _ = held.communicate("a line\\n")
killed = subprocess.Popen(inner, stdin=subprocess.PIPE)
killed.kill()
print(json.dumps({"me": me, "run": [run.returncode, json.loads(run.stdout)], "cold": json.loads(cold.stdout),
                  "other": json.loads(other.stdout),
                  "held": [waiting, timed_out, held.returncode, json.loads(out)], "killed": killed.wait()}))
"""


def test_a_nested_childs_python_children_are_forked_warm_unless_they_must_be_its_own(tmp_path):
    script = tmp_path / "nested.py"
    script.write_text(NESTED)
    child = warm.start([sys.executable, str(script)], env=child_env(), nested=True)
    out, err = child.communicate(timeout=CHILD_TIMEOUT_S)
    assert child.returncode == 0, err
    facts = json.loads(out)
    code, inner = facts["run"]
    assert code == 5 and inner["warm"] and inner["ppid"] != facts["me"] and inner["line"] == ""
    assert not facts["cold"]["warm"] and facts["cold"]["ppid"] == facts["me"]  # the launcher's rank checks its parent
    assert not facts["other"]["warm"] and facts["other"]["ppid"] == facts["me"]  # torch reads it at start: refused
    waiting, timed_out, returncode, held = facts["held"]
    assert waiting is None and timed_out and returncode == 0 and held["warm"] and held["line"] == "a line\n"
    assert facts["killed"] == -signal.SIGKILL


def test_a_module_runs_as_python_dash_m_does(tmp_path):
    (tmp_path / "probe_module.py").write_text("import json, sys\nprint(json.dumps([sys.argv, sys.path[0]]))\n")
    child = warm.start([sys.executable, "-m", "probe_module", "x"], env=child_env(), cwd=tmp_path)
    assert isinstance(child, warm.Child)
    out, err = child.communicate(timeout=CHILD_TIMEOUT_S)
    assert child.returncode == 0, err
    assert json.loads(out) == [[str(tmp_path / "probe_module.py"), "x"], str(tmp_path)]
