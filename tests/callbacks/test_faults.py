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

from tests.callbacks.test_resume import CONFIGS, SCRIPT, assert_continues, result
from tests.helpers import CHILD_TIMEOUT_S, child_env, warm

pytestmark = pytest.mark.distributed

CONFIG = "2-ranks-persistent-workers"
VALIDATION = "2-ranks-accumulate-own-sampler-validation"  # 2 optimizer steps per epoch
MAIN_ONLY = "2-ranks-in-process-data"
# A scheduler's grace period between its SIGTERM and its SIGKILL (SLURM's KillWait: 30 s by default), doubled for a
# loaded 2-core machine: a preempted job must be gone by then.
EXIT_GRACE_S = 60


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


def _start(*args, env, session=False):
    command = [sys.executable, str(SCRIPT), *map(str, args)]
    return warm.start(command, env=child_env(**env), session=session, merge_stderr=True)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Both preempted jobs side by side (each holds where the signal must come), then both requeues side by side.

    1. The job signalled as a whole at step 4 and again after its checkpoint.
    2. The job signalled while every rank holds in batch 1 of the validation pass after epoch 1 (global step 4); it
       must exit within EXIT_GRACE_S, its training loader's workers alive during the pass.
    3. A fork job whose main process alone is signalled at step 3 (it passes the signal on to the ranks).
    """
    whole, validation = tmp_path_factory.mktemp("faults"), tmp_path_factory.mktemp("validation")
    main_only = tmp_path_factory.mktemp("main-only")
    first = _start("preempt", whole, env={**CONFIGS[CONFIG][0], "PREEMPT_AT_STEP": "4", "HOLD": "1"}, session=True)
    second = _start("preempt", validation, env={**CONFIGS[VALIDATION][0], "PREEMPT_IN_VALIDATION": "1"}, session=True)
    third = _start("preempt", main_only, env={**CONFIGS[MAIN_ONLY][0], "PREEMPT_AT_STEP": "3"})
    _wait_for([whole / "ready0", whole / "ready1"], first, "both ranks reached step 4")
    os.killpg(first.pid, signal.SIGTERM)  # every process: main, ranks, data-loader workers
    _wait_for([whole / "exiting"], first, "the ranks' stop after the preemption checkpoint")
    os.killpg(first.pid, signal.SIGTERM)  # again, while the job is on its way out
    (whole / "released").write_text("")
    _wait_for([validation / "ready0", validation / "ready1"], second, "both ranks held in the validation pass")
    os.killpg(second.pid, signal.SIGTERM)
    try:  # the training loader's workers (alive during validation) must not hold the exit
        second.wait(timeout=EXIT_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(second.pid, signal.SIGKILL)
        second.wait()
    validation_exit = second.returncode
    _wait_for([main_only / "ready0", main_only / "ready1"], third, "both ranks reached step 3")
    third.send_signal(signal.SIGTERM)  # to the main process only: it forwards the signal to the forked ranks
    outputs = [proc.communicate(timeout=CHILD_TIMEOUT_S)[0] for proc in (first, second, third)]
    deadline = time.monotonic() + 30  # the kernel reaps the last workers after their rank
    while _group_alive(first.pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    left = _group_alive(first.pid)
    requeues = [
        _start("requeue", whole, env=CONFIGS[CONFIG][0]),
        _start("requeue", validation, env=CONFIGS[VALIDATION][0]),
        _start("resume", main_only / "after", main_only / "preempted.ckpt", env=CONFIGS[MAIN_ONLY][0]),
    ]
    requeued = [(proc.communicate(timeout=CHILD_TIMEOUT_S)[0], proc.returncode) for proc in requeues]
    return {
        "whole": (whole, first.returncode, outputs[0], left, requeued[0]),
        "validation": (validation, validation_exit, outputs[1], requeued[1]),
        "main-only": (main_only, third.returncode, outputs[2], requeued[2]),
    }


@pytest.fixture
def preempted(jobs):
    return jobs["whole"]


@pytest.fixture
def preempted_in_validation(jobs):
    return jobs["validation"]


def test_a_signal_to_the_whole_job_with_workers_checkpoints_and_exits_cleanly_twice_signalled(preempted):
    out, returncode, output, left, _ = preempted
    assert returncode == 0, output[-4000:]  # the documented exit code, after two signals
    assert "Preempted by signal 15" in output and "exited unexpectedly" not in output
    assert int(torch.load(out / "preempted.ckpt", weights_only=True)["global_step"]) == 5
    assert not left, "processes of the job were left running"


def test_the_requeued_job_finds_the_preemption_checkpoint_with_ckpt_path_last_and_resumes_bitwise(
    resume_runs, preempted
):
    out, _, _, _, (requeue_output, requeue_code) = preempted
    assert requeue_code == 0, requeue_output[-5000:]
    assert (out / "periodic" / "step=4.ckpt").exists()  # the newer preemption checkpoint is preferred to it
    assert os.path.realpath(out / "periodic" / "last-preempted.ckpt") == str((out / "preempted.ckpt").resolve())
    assert_continues(result(resume_runs / CONFIG / "straight"), result(out), 5)


def test_a_signal_during_validation_saves_the_training_state_at_once_and_the_pass_runs_again(
    resume_runs, preempted_in_validation
):
    out, returncode, output, requeue = preempted_in_validation
    assert returncode == 0, output[-4000:]  # exited within EXIT_GRACE_S (else killed: -9), 2 training workers per rank
    # Saved in the pass, at its next batch (the ranks held in batch 1 of 4), not after its end.
    assert "during validation: the training state at step 4" in output
    assert int(torch.load(out / "preempted.ckpt", weights_only=True)["global_step"]) == 4
    assert requeue[1] == 0, requeue[0][-5000:]
    straight, resumed = result(resume_runs / VALIDATION / "straight"), result(out)
    assert_continues(straight, resumed, 4)
    assert resumed["val"] == {epoch: loss for epoch, loss in straight["val"].items() if int(epoch) >= 1}


def test_a_signal_to_the_main_process_alone_checkpoints_at_a_step_boundary_and_the_resume_is_bitwise(resume_runs, jobs):
    out, returncode, output, (resume_output, resume_code) = jobs["main-only"]
    assert returncode == 0, output[-4000:]
    assert "Preempted by signal 15" in output and (out / "preempted.ckpt").exists()
    saved = torch.load(out / "preempted.ckpt", weights_only=True)
    assert int(saved["global_step"]) == 4  # the step that was running when the signal came, completed
    assert resume_code == 0, resume_output[-5000:]
    assert_continues(result(resume_runs / MAIN_ONLY / "straight"), result(out / "after" / "preempted"), 4)
