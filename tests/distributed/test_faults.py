"""The faults of a preemptible cluster, each put at a known step by a hand-shake (files; no sleep-and-hope).

A job of 2 gloo ranks with 2 persistent data-loader workers each, periodic checkpoints every 2 steps (no
`save_last`) and `PreemptionCheckpoint`; each rank holds at step 4 until the signal has arrived. SLURM and
Kubernetes signal every process of the job at once: the test signals the whole process group, workers included,
then again once the checkpoint is written, and requeues the job with `fit(ckpt_path="last")`. The resumed run must
be bitwise the uninterrupted one (`test_resume.py`'s straight run of the same configuration).
"""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.distributed.test_resume import CONFIGS, SCRIPT, assert_continues, result
from tests.helpers import CHILD_TIMEOUT_S, child_env

pytestmark = pytest.mark.distributed

CONFIG = "2-ranks-persistent-workers"


def _wait_for(paths, proc, what):
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while not all(path.exists() for path in paths):
        assert proc.poll() is None, f"the job ended before {what}: " + proc.communicate()[0][-4000:]
        assert time.monotonic() < deadline, f"no {what} within {CHILD_TIMEOUT_S} s"
        time.sleep(0.02)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
    """The job signalled as a whole at step 4 and again after its checkpoint; then requeued."""
    out = tmp_path_factory.mktemp("faults")
    env = {**CONFIGS[CONFIG][0], "PREEMPT_AT_STEP": "4", "HOLD": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "preempt", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=child_env(**env),
        start_new_session=True,  # its own process group, as a job step has
    )
    pgid = proc.pid
    _wait_for([out / "ready0", out / "ready1"], proc, "both ranks reached step 4")
    os.killpg(pgid, signal.SIGTERM)  # every process: main, ranks, data-loader workers
    _wait_for([out / "exiting"], proc, "the ranks' stop after the preemption checkpoint")
    os.killpg(pgid, signal.SIGTERM)  # again, while the job is on its way out
    (out / "released").write_text("")
    output = proc.communicate(timeout=CHILD_TIMEOUT_S)[0]
    deadline = time.monotonic() + 30  # the kernel reaps the last workers after their rank
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.02)
    left = _group_alive(pgid)
    requeue = subprocess.run(
        [sys.executable, str(SCRIPT), "requeue", str(out)],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        env=child_env(**CONFIGS[CONFIG][0]),
    )
    return out, proc.returncode, output, left, requeue


def test_a_signal_to_the_whole_job_with_workers_checkpoints_and_exits_cleanly_twice_signalled(preempted):
    out, returncode, output, left, _ = preempted
    assert returncode == 0, output[-4000:]  # the documented exit code, after two signals
    assert "Preempted by signal 15" in output and "exited unexpectedly" not in output
    assert int(torch.load(out / "preempted.ckpt", weights_only=True)["global_step"]) == 5
    assert not left, "processes of the job were left running"


def test_the_requeued_job_finds_the_preemption_checkpoint_with_ckpt_path_last_and_resumes_bitwise(
    resume_runs, preempted
):
    out, _, _, _, requeue = preempted
    assert requeue.returncode == 0, requeue.stdout[-3000:] + requeue.stderr[-5000:]
    assert (out / "periodic" / "step=4.ckpt").exists()  # the newer preemption checkpoint is preferred to it
    assert os.path.realpath(out / "periodic" / "last-preempted.ckpt") == str((out / "preempted.ckpt").resolve())
    assert_continues(result(resume_runs / CONFIG / "straight"), result(out), 5)


@pytest.fixture(scope="module")
def preempted_in_validation(tmp_path_factory):
    """Signalled while every rank holds in batch 1 of the validation pass after epoch 1 (global step 6); requeued."""
    out = tmp_path_factory.mktemp("validation")
    env = {**CONFIGS["2-ranks-validation"][0], "PREEMPT_IN_VALIDATION": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "preempt", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=child_env(**env),
        start_new_session=True,
    )
    _wait_for([out / "ready0", out / "ready1"], proc, "both ranks held in the validation pass")
    os.killpg(proc.pid, signal.SIGTERM)
    output = proc.communicate(timeout=CHILD_TIMEOUT_S)[0]
    requeue = subprocess.run(
        [sys.executable, str(SCRIPT), "requeue", str(out)],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        env=child_env(**CONFIGS["2-ranks-validation"][0]),
    )
    return out, proc.returncode, output, requeue


def test_a_signal_during_validation_saves_the_training_state_at_once_and_the_pass_runs_again(
    resume_runs, preempted_in_validation
):
    out, returncode, output, requeue = preempted_in_validation
    assert returncode == 0, output[-4000:]
    # Saved in the pass, at its next batch (the ranks held in batch 1 of 4), not after its end.
    assert "during validation: the training state at step 6" in output
    assert int(torch.load(out / "preempted.ckpt", weights_only=True)["global_step"]) == 6
    assert requeue.returncode == 0, requeue.stdout[-3000:] + requeue.stderr[-5000:]
    straight, resumed = result(resume_runs / "2-ranks-validation" / "straight"), result(out)
    assert_continues(straight, resumed, 6)
    assert resumed["val"] == {epoch: loss for epoch, loss in straight["val"].items() if int(epoch) >= 1}
