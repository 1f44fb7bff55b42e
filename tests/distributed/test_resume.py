"""Bitwise resume: 4 epochs straight == 2 epochs, a new process, 2 more (2 gloo ranks, dropout, shuffled
DistributedSampler, 2 augmenting workers per rank under WorkerSeedCallback, the deterministic DDP strategy)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_determinism import DeterministicDDPStrategy
from lightning_determinism.callbacks.rng_checkpoint import CHECKPOINT_KEY, RNGStateCheckpoint, _digest
from lightning_determinism.rng import capture_rng_state, restore_rng_state
from tests.helpers import CHILD_TIMEOUT_S, child_env, run_distributed

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).parent / "scripts" / "resume_run.py"


def phase(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        env=child_env(**(env or {})),
    )


def ok(*args: str, env: dict | None = None) -> str:
    result = phase(*args, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout + result.stderr


def load(path: Path) -> dict:
    return torch.load(path, weights_only=True)  # what Lightning does under torch >= 2.6


def bitwise_equal(a: dict, b: dict) -> bool:
    params = all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])
    sa, sb = a["optimizer_states"][0]["state"], b["optimizer_states"][0]["state"]
    optim = all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])
    return params and optim and a["state_dict"].keys() == b["state_dict"].keys()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    ok("straight", root / "straight")
    ok("first", root / "first")
    ok("resume", root / "resumed", root / "first" / "last.ckpt")
    return root


def test_resumed_run_is_bitwise_the_uninterrupted_one(runs):
    straight, resumed = load(runs / "straight" / "last.ckpt"), load(runs / "resumed" / "last.ckpt")
    assert straight["global_step"] == resumed["global_step"] == 20
    assert bitwise_equal(straight, resumed)


def test_persistent_workers_with_per_sample_seeding_resume_bitwise(tmp_path):
    # Live worker processes cannot be checkpointed; with per_sample=True no sample depends on a worker's stream.
    env = {"PERSIST": "1", "PERSAMPLE": "1"}
    ok("straight", tmp_path / "straight", env=env)
    ok("first", tmp_path / "first", env=env)
    ok("resume", tmp_path / "resumed", tmp_path / "first" / "last.ckpt", env=env)
    assert bitwise_equal(load(tmp_path / "straight" / "last.ckpt"), load(tmp_path / "resumed" / "last.ckpt"))


def test_checkpoint_holds_every_rank_and_loads_weights_only(runs):
    saved = load(runs / "first" / "last.ckpt")[CHECKPOINT_KEY]
    assert saved["world_size"] == 2 and len(saved["ranks"]) == 2
    assert saved["ranks"][0]["digest"] != saved["ranks"][1]["digest"]
    assert set(saved["ranks"][0]["loaders"]) == {"train/0"}


def test_without_rng_state_the_resume_diverges_and_warns(runs):
    stripped = load(runs / "first" / "last.ckpt")
    del stripped[CHECKPOINT_KEY]
    path = runs / "stripped.ckpt"
    torch.save(stripped, path)
    output = ok("resume", runs / "resumed-stripped", path)
    assert "The checkpoint holds no RNG state" in output
    assert not bitwise_equal(load(runs / "straight" / "last.ckpt"), load(runs / "resumed-stripped" / "last.ckpt"))


def test_swapped_rank_states_are_detected(runs):
    swapped = load(runs / "first" / "last.ckpt")
    entry = swapped[CHECKPOINT_KEY]
    entry["ranks"] = [entry["ranks"][1], entry["ranks"][0]]
    for i, r in enumerate(entry["ranks"]):
        r["digest"] = json.dumps(i)  # digests kept in saving order: restoring rank r's entry no longer matches
    path = runs / "swapped.ckpt"
    torch.save(swapped, path)
    result = phase("resume", runs / "resumed-swapped", path)
    assert result.returncode != 0
    assert "RNG states after resume do not match the checkpoint" in result.stdout + result.stderr


def test_mid_epoch_resume_is_reproducible_with_itself(runs):
    ok("first-steps", runs / "mid")
    for name in ("a", "b"):
        ok("resume", runs / f"mid-{name}", runs / "mid" / "step=5.ckpt")
    a, b = load(runs / "mid-a" / "last.ckpt"), load(runs / "mid-b" / "last.ckpt")
    assert a["global_step"] == b["global_step"] == 20
    assert bitwise_equal(a, b)
    # Not the uninterrupted run: Lightning re-iterates a plain DataLoader from the epoch's first batch (documented).
    assert not bitwise_equal(a, load(runs / "straight" / "last.ckpt"))


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

    from tests.lightning_models import RecordingModule

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
