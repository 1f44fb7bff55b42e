"""Bitwise resume from any step: the uninterrupted run against runs resumed in a new process from its checkpoints
(first, middle and last step of an epoch, the last step of the run), on 1, 2 and 4 gloo ranks, with 0 and 2 workers
(per-sample seeding, persistent workers), OneCycleLR sized by `estimated_stepping_batches`; preemption by SIGTERM."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_determinism.callbacks.rng_checkpoint import CHECKPOINT_KEY, RNGStateCheckpoint, _digest
from lightning_determinism.seeding.rng import capture_rng_state, restore_rng_state
from tests.helpers import CHILD_TIMEOUT_S, child_env, run_distributed, warm

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).parents[1] / "helpers" / "scripts" / "resume_run.py"

# name: (environment, checkpoints to resume from). 2 ranks: 3 steps per epoch, 9 in all; 1 rank: 6 and 18.
CONFIGS = {
    "2-ranks-in-process-data": ({"DEVICES": "2", "WORKERS": "0"}, [4, 5, 6, 9]),
    # More than two ranks: DDP's ring sums depend on the bucket layout, which the resumed run rebuilds (see
    # tree.PairwiseAllReduce; without it the parameters differed in their last bits from the first resumed step).
    "4-ranks-in-process-data": ({"DEVICES": "4", "WORKERS": "0"}, [3]),
    "2-ranks-persistent-workers": ({"DEVICES": "2", "WORKERS": "2", "PERSAMPLE": "1", "PERSIST": "1"}, [5, 6]),
    # Per-worker seeds: the resumed workers take over the roles of the uninterrupted run's and replay their fetches
    # (step 4: the next batch was worker 1's; step 5: worker 0's, after two batches each had drawn for).
    "2-ranks-per-worker-seeds": ({"DEVICES": "2", "WORKERS": "2", "PERSAMPLE": "0"}, [4, 5]),
    "1-rank-workers": ({"DEVICES": "1", "WORKERS": "2", "PERSAMPLE": "1"}, [7, 9, 12, 18]),
    "1-rank-unshuffled-in-process-data": ({"DEVICES": "1", "WORKERS": "0", "SHUFFLE": "0"}, [3, 12]),
    # Gradient accumulation (3 steps per epoch on 1 rank, 2 on 2): each resume starts inside an accumulation window,
    # under ModelCheckpoint(every_n_train_steps=1), which must not save the resumed step again there. The same runs
    # leave the samplers to the user (use_distributed_sampler=False): their own DistributedSampler on 2 ranks, a
    # RandomSampler with 2 workers (per-worker seeds, replayed) on 1; and validate after every epoch on 2 ranks with 2
    # training workers each (the uninterrupted run of test_faults.py's preemption during validation).
    "1-rank-accumulate-own-sampler-workers": (
        {"DEVICES": "1", "WORKERS": "2", "PERSAMPLE": "0", "ACCUM": "2", "OWN_SAMPLER": "1"},
        [4],
    ),
    "2-ranks-accumulate-own-sampler-validation": (
        {"DEVICES": "2", "WORKERS": "2", "PERSAMPLE": "1", "ACCUM": "2", "OWN_SAMPLER": "1", "VALIDATE": "1"},
        [2],
    ),
}


def phase(*args, env=None, timeout=CHILD_TIMEOUT_S) -> subprocess.CompletedProcess:
    command = [sys.executable, str(SCRIPT), *map(str, args)]
    process = warm.start(command, env=child_env(**(env or {})))
    out, err = process.communicate(timeout=timeout)
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def ok(*args, env=None) -> str:
    result = phase(*args, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result.stdout + result.stderr


def result(path: Path) -> dict:
    return json.loads((path / "result.json").read_text())


def assert_continues(straight: dict, resumed: dict, k: int) -> None:
    assert resumed["global_step"] == straight["global_step"]
    later = {step: loss for step, loss in straight["losses"].items() if int(step) > k}
    assert resumed["losses"] == later  # the logged (synced) loss of every later step, bit for bit
    for key in ("params", "optimizer", "scheduler"):
        assert resumed[key] == straight[key], key


@pytest.fixture
def runs(resume_runs):  # tests/callbacks/conftest.py: one set of runs for this module and test_faults.py
    return resume_runs


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_resuming_from_any_step_is_bitwise_the_uninterrupted_run(runs, name):
    straight = result(runs / name / "straight")
    assert len(straight["losses"]) == straight["global_step"] > 0
    for k in CONFIGS[name][1]:
        assert_continues(straight, result(runs / name / "resumed" / f"step={k}"), k)


def test_checkpoints_hold_every_rank_and_load_weights_only(runs):
    saved = torch.load(runs / "2-ranks-in-process-data" / "straight" / "step=5.ckpt", weights_only=True)
    entry = saved[CHECKPOINT_KEY]
    assert entry["world_size"] == 2 and len(entry["ranks"]) == 2
    assert entry["ranks"][0]["digest"] != entry["ranks"][1]["digest"]
    data = [rank["data"][0] for rank in entry["ranks"]]
    assert [(d["epoch"], d["skip"]) for d in data] == [(1, 2), (1, 2)]  # step 5: epoch 1, after its second batch
    assert data[0]["epoch_start"]["torch"].dtype == torch.uint8


def _edited(runs, edit, name):
    checkpoint = torch.load(runs / "2-ranks-in-process-data" / "straight" / "step=5.ckpt", weights_only=True)
    edit(checkpoint)
    path = runs / f"{name}.ckpt"
    torch.save(checkpoint, path)
    return path


@pytest.fixture(scope="module")
def edited_resumes(resume_runs):
    """Step 5 of the 2-rank run, edited three ways, resumed by one process in turn (the swapped one fails last)."""

    def no_position(c):
        for rank in c[CHECKPOINT_KEY]["ranks"]:
            del rank["data"]  # as written before mid-epoch resume existed

    def swap(c):
        entry = c[CHECKPOINT_KEY]
        entry["ranks"] = [entry["ranks"][1], entry["ranks"][0]]
        for i, r in enumerate(entry["ranks"]):
            r["digest"] = json.dumps(i)  # digests in saving order: restoring rank r's entry no longer matches

    paths = [
        _edited(resume_runs, lambda c: c.pop(CHECKPOINT_KEY), "stripped"),
        _edited(resume_runs, no_position, "old"),
        _edited(resume_runs, swap, "swapped"),
    ]
    return phase("resume", resume_runs / "edited", *paths, env=CONFIGS["2-ranks-in-process-data"][0])


def test_without_rng_state_or_data_position_the_resume_warns_and_differs(runs, edited_resumes):
    output = edited_resumes.stdout + edited_resumes.stderr
    assert "The checkpoint holds no RNG state" in output
    assert "holds no data position (written before mid-epoch resume was supported)" in output
    straight = result(runs / "2-ranks-in-process-data" / "straight")
    for name in ("stripped", "old"):
        resumed = result(runs / "edited" / name)
        assert resumed["global_step"] == straight["global_step"]
        assert resumed["params"] != straight["params"]  # the test can tell a wrong resume from a right one


def test_swapped_rank_states_are_detected(edited_resumes):
    assert edited_resumes.returncode != 0
    assert "RNG states after resume do not match the checkpoint" in edited_resumes.stdout + edited_resumes.stderr


def _restore_rank_zero_everywhere(rank, world_size):
    torch.manual_seed(100 + rank)
    mine = capture_rng_state()
    saved = {"ranks": [{"digest": d} for d in _gather(_digest(mine))]}
    if rank == 1:
        restore_rng_state(_broadcast_state(mine))  # the Megatron-style bug: rank 0's state on rank 1
    else:
        _broadcast_state(mine)
    with pytest.raises(RuntimeError, match=r"ranks \[1\] hold another rank's"):
        RNGStateCheckpoint()._verify(saved, rank)


def _gather(obj):
    out = [None, None]
    torch.distributed.all_gather_object(out, obj)
    return out


def _broadcast_state(state):
    box = [state]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def test_verification_catches_one_rank_state_copied(tmp_path):
    run_distributed(_restore_rank_zero_everywhere, tmp_path)


def test_deterministic_strategy_adds_the_callback(tmp_path):
    import lightning as L

    from lightning_determinism import DeterministicDDPStrategy
    from tests.helpers.lightning_models import RecordingModule

    class Probe(L.Callback):
        def on_fit_start(self, trainer, pl_module):
            count = sum(isinstance(cb, RNGStateCheckpoint) for cb in trainer.callbacks)
            (tmp_path / f"probe{trainer.global_rank}").write_text(str(count))

    trainer = L.Trainer(
        strategy=DeterministicDDPStrategy(seed=1, start_method="fork"),
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        callbacks=[Probe(), RNGStateCheckpoint()],  # the user's own: no second one is added
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(RecordingModule(str(tmp_path)))
    assert [(tmp_path / f"probe{r}").read_text() for r in range(2)] == ["1", "1"]
