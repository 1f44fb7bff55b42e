"""``ckpt_path="last"`` resolved once: every rank resumes from the checkpoint rank 0 (or the main process) chose.

The ranks of a job launched from outside (torchrun, the popen launcher's child scripts) are played by forked gloo
ranks that build their own Trainer with ``LOCAL_RANK`` set, as such a rank does. The race of the issue (the newest
``last*.ckpt`` changing while the ranks look) is put in place by a hand-shake: rank 0 lists the directory, then
another run's newer ``last-v1.ckpt`` appears, then rank 1 may list it.
"""

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.environments import LightningEnvironment

from lightning_determinism import DeterministicDDPStrategy
from tests.helpers import run_distributed
from tests.helpers.lightning_models import RecordingModule, quiet_trainer

pytestmark = pytest.mark.distributed


class _Start(Callback):
    """Writes the step each rank starts training at and the checkpoint it loaded."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer, pl_module) -> None:
        record = {"step": trainer.global_step, "ckpt_path": trainer.ckpt_path}
        (self.out / f"start{trainer.global_rank}.json").write_text(json.dumps(record))


def _trainer(out: Path, max_epochs: int, *callbacks):
    strategy = DeterministicDDPStrategy(seed=3, cluster_environment=LightningEnvironment())
    return quiet_trainer(strategy, 2, max_epochs=max_epochs, callbacks=[_Start(out), *callbacks],
                         default_root_dir=str(out), enable_checkpointing=bool(callbacks))  # fmt: skip


def _as_launched_from_outside(rank: int) -> None:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")  # a forked rank: its own environment


def _write_checkpoints(rank, world_size, out):
    """Two epochs of 2 steps each on 2 ranks, a checkpoint at each epoch's end."""
    _as_launched_from_outside(rank)
    every = ModelCheckpoint(dirpath=out / "all", save_top_k=-1, filename="{step}")
    _trainer(out, 2, every).fit(RecordingModule(str(out), n=16, record_draws=False), ckpt_path="last")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = tmp_path_factory.mktemp("checkpoints")
    run_distributed(_write_checkpoints, out, out)
    starts = [json.loads((out / f"start{rank}.json").read_text()) for rank in (0, 1)]
    assert starts == [{"step": 0, "ckpt_path": None}] * 2  # "last" in an empty directory: every rank afresh
    assert sorted(os.listdir(out / "all")) == ["step=2.ckpt", "step=4.ckpt"]
    return out


def _race(rank, world_size, out, older, newer):
    """Rank 0 lists the directory (only ``older`` is there as last.ckpt), then ``newer`` appears, then rank 1 lists."""
    _as_launched_from_outside(rank)
    directory, looked = out / "ckpts", out / "rank0-looked"
    original = ModelCheckpoint._find_last_checkpoints

    def racing(self, trainer):
        if trainer.global_rank == 0:
            found = original(self, trainer)
            shutil.copy(newer, directory / "last-v1.ckpt")  # another run's save, newer than last.ckpt
            looked.write_text("")
            return found
        deadline = time.monotonic() + 30
        while not looked.exists():  # the hand-shake: rank 1 lists only once the directory has changed
            assert time.monotonic() < deadline, "rank 0 never listed the directory"
            time.sleep(0.005)
        return original(self, trainer)

    ModelCheckpoint._find_last_checkpoints = racing
    keep = ModelCheckpoint(dirpath=directory, save_top_k=0)
    _trainer(out, 3, keep).fit(RecordingModule(str(out), n=16, record_draws=False), ckpt_path="last")


def test_a_newest_last_checkpoint_that_changes_while_the_ranks_look_is_resolved_once(checkpoints, tmp_path):
    (tmp_path / "ckpts").mkdir()
    shutil.copy(checkpoints / "all" / "step=2.ckpt", tmp_path / "ckpts" / "last.ckpt")
    run_distributed(_race, tmp_path, tmp_path, checkpoints / "all" / "step=2.ckpt", checkpoints / "all" / "step=4.ckpt")
    starts = [json.loads((tmp_path / f"start{rank}.json").read_text()) for rank in (0, 1)]
    # Both resume rank 0's choice (stock: rank 0 from last.ckpt at step 2, rank 1 from last-v1.ckpt at step 4, and a
    # hang in the first collective that pairs differently); rank 1 never looked.
    assert starts == [{"step": 2, "ckpt_path": str(tmp_path / "ckpts" / "last.ckpt")}] * 2
    assert (tmp_path / "ckpts" / "last-v1.ckpt").exists()


def _different_paths(rank, world_size, out, paths):
    _as_launched_from_outside(rank)
    try:
        _trainer(out, 3).fit(RecordingModule(str(out), n=16, record_draws=False), ckpt_path=str(paths[rank]))
    except RuntimeError as err:
        (out / f"error{rank}.txt").write_text(str(err))
        return
    raise AssertionError("resumed from different checkpoints")


def test_ranks_given_different_checkpoints_are_refused_in_one_line_naming_both(checkpoints, tmp_path):
    paths = [checkpoints / "all" / "step=2.ckpt", checkpoints / "all" / "step=4.ckpt"]
    run_distributed(_different_paths, tmp_path, tmp_path, paths)
    for rank in (0, 1):
        message = (tmp_path / f"error{rank}.txt").read_text()
        assert "\n" not in message and message.startswith(f"[rank: {rank}] the ranks would resume from different")
        assert f"rank 0 from {paths[0]} (" in message and f"rank 1 from {paths[1]} (" in message, message
    assert not (tmp_path / "start0.json").exists()  # nothing trained


def test_a_fork_launch_resolves_last_in_the_main_process_and_hands_the_ranks_the_file(
    checkpoints, tmp_path, monkeypatch
):
    directory = tmp_path / "ckpts"
    directory.mkdir()
    shutil.copy(checkpoints / "all" / "step=4.ckpt", directory / "last.ckpt")
    listed = tmp_path / "listed-by"
    original = ModelCheckpoint._find_last_checkpoints

    def recording(self, trainer):
        with open(listed, "a") as file:
            file.write(f"{os.getpid()}\n")
        return original(self, trainer)

    monkeypatch.setattr(ModelCheckpoint, "_find_last_checkpoints", recording)
    strategy = DeterministicDDPStrategy(seed=3, start_method="fork")
    callbacks = [_Start(tmp_path), ModelCheckpoint(directory, save_top_k=0)]
    trainer = quiet_trainer(strategy, 2, max_epochs=3, callbacks=callbacks, enable_checkpointing=True)
    trainer.fit(RecordingModule(str(tmp_path), n=16, record_draws=False), ckpt_path="last")
    assert listed.read_text().split() == [str(os.getpid())]  # once, here: no rank looked
    starts = [json.loads((tmp_path / f"start{rank}.json").read_text()) for rank in (0, 1)]
    assert starts == [{"step": 4, "ckpt_path": str(directory / "last.ckpt")}] * 2
    assert int(torch.load(directory / "last.ckpt", weights_only=True)["global_step"]) == 4  # left as it was


def _resume_last(rank, world_size, out):
    _as_launched_from_outside(rank)
    keep = ModelCheckpoint(dirpath=out / "ckpts", save_top_k=0)
    _trainer(out, 3, keep).fit(RecordingModule(str(out), n=16, record_draws=False), ckpt_path="last")


def test_a_publish_killed_between_its_two_renames_is_settled_by_rank_0_before_it_resolves_last(checkpoints, tmp_path):
    # No RENAME_EXCHANGE (NFS): the old last.ckpt was put aside, the kill came before the new one was put in place.
    # Launched from outside, no main process settles it before the ranks start; rank 0 does, then resolves "last".
    from lightning_determinism.checkpoints.publish import hidden_path

    directory = tmp_path / "ckpts"
    directory.mkdir()
    shutil.copy(checkpoints / "all" / "step=2.ckpt", hidden_path(directory / "last.ckpt", "a" * 16, "old"))
    shutil.copy(checkpoints / "all" / "step=4.ckpt", hidden_path(directory / "last.ckpt", "a" * 16, "tmp"))
    run_distributed(_resume_last, tmp_path, tmp_path)
    starts = [json.loads((tmp_path / f"start{rank}.json").read_text()) for rank in (0, 1)]
    assert starts == [{"step": 4, "ckpt_path": str(directory / "last.ckpt")}] * 2  # stock: none found, afresh
    assert os.listdir(directory) == ["last.ckpt"]
