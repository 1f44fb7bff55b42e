"""Distributed checkpoints written under a hidden name and published whole; directories mixed from two saves refused.

The multi-process runs (scripts/distributed_publish_run.py: DeterministicModelParallelStrategy, FSDP2 on 2 forked gloo
ranks) go in two waves of child processes side by side: a straight run and a run killed during its step-4 rewrite of
``last.ckpt/``; then a resume of each and a resume from a directory mixed from two of the straight run's saves.
"""

import json
import os
import re
import shutil
import sys
import warnings
from pathlib import Path

import pytest
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

from lightning_determinism import DeterministicModelParallelStrategy
from lightning_determinism.checkpoints import publish as publish_module
from lightning_determinism.checkpoints.distributed import check_distributed_checkpoint, load_distributed_checkpoint
from lightning_determinism.checkpoints.file import DamagedCheckpointError
from lightning_determinism.checkpoints.io import check_resume_path
from lightning_determinism.checkpoints.publish import MARK, finish_interrupted_publish, hidden_path, publish
from lightning_determinism.errors import DeterminismWarning
from tests.helpers import CHILD_TIMEOUT_S, child_env, warm

SCRIPT = Path(__file__).parents[1] / "helpers" / "scripts" / "distributed_publish_run.py"


def _run(root: Path, *phases: str) -> dict[str, tuple[str, int]]:
    procs = {
        phase: warm.start([sys.executable, str(SCRIPT), str(root), phase], env=child_env(), merge_stderr=True)
        for phase in phases
    }
    return {phase: (proc.communicate(timeout=CHILD_TIMEOUT_S)[0], proc.returncode) for phase, proc in procs.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("publish")
    first = _run(root, "straight", "killed")
    assert first["straight"][1] == 0, first["straight"][0][-4000:]
    assert first["killed"][1] != 0 and "SIGKILL" in first["killed"][0], first["killed"][0][-4000:]
    after_kill = sorted(os.listdir(root / "killed"))  # before the resume saves into that directory again
    mark = root / "killed" / "last.ckpt" / MARK
    killed_mark = json.loads(mark.read_text()) if mark.is_file() else None
    (root / "mixed").mkdir()
    shutil.copytree(root / "straight" / "step=4.ckpt", root / "mixed" / "last.ckpt")
    shutil.copy(root / "straight" / "step=2.ckpt" / "meta.pt", root / "mixed" / "last.ckpt" / "meta.pt")
    second = _run(root, "resumed", "killed-resumed", "mixed-last")
    for phase in ("resumed", "killed-resumed"):
        assert second[phase][1] == 0, second[phase][0][-4000:]
    return root, after_kill, killed_mark, second["mixed-last"]


def _record(root: Path, phase: str, rank: int = 0) -> dict:
    return json.loads((root / phase / f"rank{rank}.json").read_text())


@pytest.mark.distributed
def test_a_save_killed_after_its_shards_leaves_the_previous_checkpoint_and_last_resumes_it(runs):
    root, after_kill, killed_mark, _ = runs
    killed, resumed, straight = _record(root, "killed"), _record(root, "killed-resumed"), _record(root, "straight")
    assert resumed["start"] == {"step": 2, "digest": killed["steps"]["2"]}  # step 2's weights with step 2's loops
    # the step-4 shards went to a hidden directory: last.ckpt/ is still the whole step-2 checkpoint
    assert killed_mark is not None and killed_mark["global_step"] == 2
    hidden = [name for name in after_kill if name.startswith(".")]
    assert len(hidden) == 1 and hidden[0].startswith(".last.ckpt.") and hidden[0].endswith(".tmp"), after_kill
    for rank in (0, 1):
        assert _record(root, "killed-resumed", rank)["steps"]["6"] == _record(root, "straight", rank)["steps"]["6"]
    assert straight["steps"]["6"] == resumed["steps"]["6"]
    # The next saves left it: from there a save a kill cut short looks like another run's in progress (named once).
    assert [name for name in os.listdir(root / "killed") if name.startswith(".")] == hidden


@pytest.mark.distributed
def test_a_normal_save_and_resume_leave_marked_checkpoints_and_nothing_hidden(runs):
    root = runs[0]
    names = sorted(os.listdir(root / "straight"))
    assert [n for n in names if n.endswith(".ckpt")] == ["last.ckpt", "step=2.ckpt", "step=4.ckpt", "step=6.ckpt"]
    assert not [n for n in names if n.startswith(".")]
    for name in ("step=2.ckpt", "last.ckpt"):
        mark = json.loads((root / "straight" / name / MARK).read_text())
        assert mark["world_size"] == 2 and mark["global_step"] == (2 if name == "step=2.ckpt" else 6)
        check_distributed_checkpoint(root / "straight" / name)
    assert _record(root, "resumed")["start"]["step"] == 2
    assert _record(root, "resumed")["steps"]["6"] == _record(root, "straight")["steps"]["6"]
    checkpoint = load_distributed_checkpoint(root / "straight" / "step=4.ckpt")  # the marks are not in it
    assert checkpoint["global_step"] == 4 and not [k for k in checkpoint if k.startswith("lightning_determinism_save")]


def _mixed(root: Path, tmp_path: Path, part: str) -> Path:
    target = tmp_path / "step=4.ckpt"
    shutil.copytree(root / "straight" / "step=4.ckpt", target)
    shutil.copy(root / "straight" / "step=2.ckpt" / part, target / part)
    return target


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("part", "expected"),
    [
        ("meta.pt", r"meta\.pt \(step 2\) is not the one save [0-9a-f]{16} \(step 4\) wrote"),
        ("__1_0.distcp", r"the shard file __1_0\.distcp is from save [0-9a-f]{16}, the rest from save \w+ \(step 4\)"),
        (".metadata", r"its index \.metadata is not the one save [0-9a-f]{16} \(step 4\) wrote"),
    ],
)
def test_a_directory_mixed_from_two_saves_is_refused_before_launch_naming_it(runs, tmp_path, part, expected):
    target = _mixed(runs[0], tmp_path, part)
    with pytest.raises(DamagedCheckpointError) as info:
        check_resume_path(DeterministicModelParallelStrategy(), target)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"`ckpt_path`: {target}: a distributed checkpoint mixed")
    assert re.search(expected, message), message


@pytest.mark.distributed
def test_a_mixed_last_checkpoint_is_refused_by_every_rank_before_training(runs):
    root, _, _, (output, returncode) = runs
    assert returncode != 0
    assert "Restored all states" not in output
    assert not (root / "mixed-last" / "rank0.json").exists()  # no training step ran
    lines = [line for line in output.splitlines() if line.startswith("lightning_determinism.checkpoints.file.Damaged")]
    assert lines, output[-4000:]
    directory = root / "mixed" / "last.ckpt"
    assert f"{directory}: a distributed checkpoint mixed from two saves: meta.pt (step 2)" in lines[0], lines


# --- the publish protocol on plain directories: one process ---------------------------------------------------------


def _checkpoint_dir(path: Path, text: str) -> Path:
    path.mkdir(parents=True)
    (path / "meta.pt").write_text(text)
    return path


@pytest.mark.parametrize("swap", [True, False], ids=["exchange", "two-renames"])
def test_publishing_replaces_the_old_directory_and_leaves_nothing_of_its_own_hidden(tmp_path, monkeypatch, swap):
    if not swap:
        monkeypatch.setattr(publish_module, "_exchange", lambda a, b: False)  # NFS: no RENAME_EXCHANGE
    monkeypatch.setattr(publish_module, "_SAID", set())
    final = _checkpoint_dir(tmp_path / "last.ckpt", "old")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeterminismWarning)  # nothing of another's beside it: nothing to say
        publish(_checkpoint_dir(hidden_path(final, "a" * 16), "new"), final)
    assert (final / "meta.pt").read_text() == "new"
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]


def test_another_runs_save_in_progress_beside_it_is_left_whole_and_named_once(tmp_path, monkeypatch):
    monkeypatch.setattr(publish_module, "_SAID", set())
    final = _checkpoint_dir(tmp_path / "last.ckpt", "old")
    theirs = _checkpoint_dir(hidden_path(final, "f" * 16), "another run, still writing")
    (theirs / "__0_0.distcp").write_bytes(b"shard")
    with pytest.warns(DeterminismWarning, match=r"hidden saves of last.ckpt that this run did not write") as said:
        publish(_checkpoint_dir(hidden_path(final, "a" * 16), "new"), final)
    assert theirs.name in str(said[0].message)
    assert (theirs / "meta.pt").read_text() == "another run, still writing" and (theirs / "__0_0.distcp").exists()
    assert (final / "meta.pt").read_text() == "new"
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeterminismWarning)  # once per directory
        publish(_checkpoint_dir(hidden_path(final, "b" * 16), "newer"), final)
    assert theirs.exists() and (final / "meta.pt").read_text() == "newer"


def test_a_kill_between_the_two_renames_is_settled_by_the_check_before_the_resume(tmp_path, monkeypatch):
    monkeypatch.setattr(publish_module, "_exchange", lambda a, b: False)
    final = _checkpoint_dir(tmp_path / "preempted.ckpt", "old")
    hidden = _checkpoint_dir(hidden_path(final, "b" * 16), "new")
    renames = []

    def rename_then_die(source, target):
        if renames:
            raise KeyboardInterrupt  # the kill: after the old one was put aside, before the new one was put in place
        renames.append(target)
        os.replace(source, target)

    monkeypatch.setattr(publish_module.os, "rename", rename_then_die)
    with pytest.raises(KeyboardInterrupt):
        publish(hidden, final)
    monkeypatch.undo()
    assert not final.exists() and len(os.listdir(tmp_path)) == 2  # both whole, both hidden
    with pytest.warns(DeterminismWarning, match=r"preempted\.ckpt: a save was killed while publishing it; the new"):
        with pytest.raises(DamagedCheckpointError):  # settled, then checked: the fake shards are no checkpoint
            check_resume_path(DeterministicModelParallelStrategy(), final)
    assert (final / "meta.pt").read_text() == "new" and os.listdir(tmp_path) == ["preempted.ckpt"]


def test_a_save_killed_before_publishing_stays_hidden_and_no_lookup_of_lightning_finds_it(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    _checkpoint_dir(tmp_path / "hpc_ckpt_1.ckpt", "1")
    _checkpoint_dir(hidden_path(tmp_path / "hpc_ckpt_2.ckpt", "c" * 16), "2")
    _checkpoint_dir(hidden_path(tmp_path / "last.ckpt", "d" * 16), "last")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert finish_interrupted_publish(tmp_path / "last.ckpt") is None  # not published: not put in place
    assert _CheckpointConnector.hpc_save_path(tmp_path).endswith("hpc_ckpt_2.ckpt")  # the hidden one has no version

    class Trainer:  # what ModelCheckpoint reads to find its last*.ckpt
        default_root_dir, loggers, log_dir = str(tmp_path), [], None

    assert ModelCheckpoint(dirpath=tmp_path)._find_last_checkpoints(Trainer()) == set()
