"""AtomicCheckpointIO: saves whole or not at all where the checkpoint lives; damaged files refused, once, by name."""

import errno
import os
import re
import shutil
import struct
import subprocess
import tempfile
import zipfile
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_determinism import (
    AtomicCheckpointIO,
    DamagedCheckpointError,
    DeterministicDDPStrategy,
    DeterministicFabricDDPStrategy,
    DeterministicFabricSingleDeviceStrategy,
    DeterministicFSDPStrategy,
    DeterministicSingleDeviceStrategy,
    cli,
)
from lightning_determinism.checkpoints.atomic import write_atomically
from lightning_determinism.checkpoints.file import check_checkpoint_file
from lightning_determinism.checkpoints.integrity import DIGEST_KEY, checkpoint_digest
from lightning_determinism.checkpoints.io import check_resume_path


@pytest.fixture
def tmpdir_env(tmp_path, monkeypatch):
    """An empty TMPDIR of the test's own, to see that nothing is left there."""
    directory = tmp_path / "TMPDIR"
    directory.mkdir()
    monkeypatch.setenv("TMPDIR", str(directory))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    return directory


def _checkpoint(n: int = 1000) -> dict:
    torch.manual_seed(0)
    return {"epoch": 1, "state_dict": {"w": torch.randn(n)}, "optimizer_states": [{"state": {0: {"step": 3}}}]}


def _listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@pytest.mark.parametrize(
    "failure",
    [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt(), ValueError("cannot pickle this")],
    ids=["ENOSPC", "KeyboardInterrupt", "exception"],
)
def test_a_save_that_fails_half_way_leaves_the_previous_file_and_no_temporary_file(
    tmp_path, tmpdir_env, monkeypatch, failure
):
    path = tmp_path / "ckpt" / "preempted.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint(_checkpoint(), path)
    before = path.read_bytes()

    def half_a_save(obj, file):
        file.write(before[: len(before) // 2])  # some bytes reach the disk, then the disk is full
        raise failure

    monkeypatch.setattr(torch, "save", half_a_save)
    with pytest.raises(type(failure)) as info:
        io.save_checkpoint(_checkpoint(2000), path)
    if isinstance(failure, OSError):  # one error naming the file
        assert str(info.value) == f"[Errno {errno.ENOSPC}] No space left on device: '{path}'"
    assert path.read_bytes() == before
    assert _listing(path.parent) == ["preempted.ckpt"]
    assert _listing(tmpdir_env) == []


def test_a_failed_sync_leaves_the_previous_file_and_no_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "baseline.json"
    write_atomically(path, '{"format": 1}')

    def failing_fsync(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match=f"^\\[Errno {errno.EIO}\\] Input/output error: '{path}'$"):
        write_atomically(path, '{"format": 1, "steps": []}')
    assert path.read_text() == '{"format": 1}'
    assert _listing(tmp_path) == ["baseline.json"]


def test_a_saved_file_keeps_the_permissions_of_the_one_it_replaces(tmp_path):
    path = tmp_path / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint(_checkpoint(), path)
    path.chmod(0o640)
    io.save_checkpoint(_checkpoint(), path)
    assert path.stat().st_mode & 0o777 == 0o640


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2 MB tmpfs, where the machine lets us mount one (root, in CI); else the test is skipped."""
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    mount = shutil.which("mount")
    if mount is None or os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root and mount(8); the ENOSPC test above simulates a full disk")
    done = subprocess.run([mount, "-t", "tmpfs", "-o", "size=2M", "tmpfs", str(mount_point)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {done.stderr.decode().strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


def test_a_disk_that_fills_during_the_save_keeps_the_previous_checkpoint(small_tmpfs, tmpdir_env):
    path = small_tmpfs / "preempted.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint(_checkpoint(100_000), path)  # 400 kB: fits
    before = path.read_bytes()
    with pytest.raises(OSError) as info:  # torch's zip writer says "unexpected pos": the plugin says what happened
        io.save_checkpoint(_checkpoint(450_000), path)  # 1.8 MB: would fit in place of the old one, not beside it
    assert str(info.value) == f"[Errno {errno.ENOSPC}] No space left on device: '{path}'"
    assert path.read_bytes() == before
    assert _listing(small_tmpfs) == ["preempted.ckpt"]
    assert _listing(tmpdir_env) == []


class _OwnIO(TorchCheckpointIO):
    """A user's plugin: left as it is."""


class _ForeignIO(CheckpointIO):
    """A user's plugin of another format."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        raise NotImplementedError

    def load_checkpoint(self, path, map_location=None, weights_only=None):
        raise NotImplementedError

    def remove_checkpoint(self, path):
        raise NotImplementedError


def _trainer(strategy, devices=1, **kwargs):
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, logger=False, **kwargs)


def test_the_strategies_use_the_plugin_by_default_and_keep_a_users_own():
    assert type(_trainer(DeterministicDDPStrategy(start_method="fork"), 2).strategy.checkpoint_io) is AtomicCheckpointIO
    assert type(_trainer(DeterministicSingleDeviceStrategy()).strategy.checkpoint_io) is AtomicCheckpointIO
    own = _OwnIO()
    assert _trainer(DeterministicDDPStrategy(start_method="fork"), 2, plugins=[own]).strategy.checkpoint_io is own
    assert _trainer(DeterministicSingleDeviceStrategy(checkpoint_io=own)).strategy.checkpoint_io is own
    # Lightning's own default, passed on: replaced.
    stock = _trainer(DeterministicSingleDeviceStrategy(), plugins=[TorchCheckpointIO()]).strategy.checkpoint_io
    assert type(stock) is AtomicCheckpointIO
    # FSDP saves and loads its own way: left to Lightning.
    assert type(DeterministicFSDPStrategy().checkpoint_io) is TorchCheckpointIO


def test_the_fabric_strategies_use_the_plugin_by_default_and_keep_a_users_own(tmp_path):
    fabric = Fabric(strategy=DeterministicFabricDDPStrategy(start_method="fork"), accelerator="cpu", devices=2)
    assert type(fabric.strategy.checkpoint_io) is AtomicCheckpointIO
    own = _OwnIO()
    fabric = Fabric(strategy=DeterministicFabricSingleDeviceStrategy(device="cpu"), accelerator="cpu", plugins=[own])
    assert fabric.strategy.checkpoint_io is own
    fabric = Fabric(strategy=DeterministicFabricSingleDeviceStrategy(device="cpu"), accelerator="cpu")
    fabric.save(tmp_path / "state.ckpt", {"step": 3, "w": torch.ones(2)})
    assert _listing(tmp_path) == ["state.ckpt"]
    loaded = fabric.load(tmp_path / "state.ckpt")
    assert loaded["step"] == 3 and torch.equal(loaded["w"], torch.ones(2))


class _Boring(BoringModel):
    def setup(self, stage):
        Path(os.environ["LDET_TEST_SETUP_MARKER"]).write_text(str(os.getpid()))  # a rank came to life


def _fit(tmp_path, plugins=(), ckpt_path=None, strategy=None, **kwargs):
    trainer = _trainer(
        strategy or DeterministicSingleDeviceStrategy(seed=1),
        plugins=list(plugins),
        max_steps=2,
        limit_val_batches=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        **kwargs,
    )
    trainer.fit(_Boring(), ckpt_path=ckpt_path)
    return trainer


@pytest.fixture
def marker(tmp_path, monkeypatch):
    path = tmp_path / "setup-ran"
    monkeypatch.setenv("LDET_TEST_SETUP_MARKER", str(path))
    return path


@pytest.fixture
def saved(tmp_path, marker):
    """A checkpoint with a digest, written by ModelCheckpoint through the strategy's plugin."""
    callback = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=2)
    _fit(tmp_path, [AtomicCheckpointIO(digest=True)], callbacks=[callback])
    (path,) = (tmp_path / "ckpt").iterdir()
    return path


def _flip_a_bit_in_the_weight(path: Path) -> None:
    weight = torch.load(path, weights_only=True)["state_dict"]["layer.weight"].numpy().tobytes()
    with zipfile.ZipFile(path) as archive:  # torch stores its records uncompressed: the weight's bytes are in one
        (record,) = (i for i in archive.infolist() if "/data/" in i.filename and archive.read(i) == weight)
    data = bytearray(path.read_bytes())
    name_length, extra_length = struct.unpack("<HH", data[record.header_offset + 26 : record.header_offset + 30])
    start = record.header_offset + 30 + name_length + extra_length
    data[start + record.file_size // 2] ^= 0x10
    path.write_bytes(bytes(data))


def test_model_checkpoint_files_carry_the_digest_and_load_back(saved):
    checkpoint = torch.load(saved, weights_only=True)
    assert checkpoint[DIGEST_KEY]["algorithm"] == "sha256"
    assert DIGEST_KEY not in AtomicCheckpointIO().load_checkpoint(saved)
    assert _listing(saved.parent) == [saved.name]


@pytest.mark.parametrize("digest", [True, False], ids=["with-digest", "default"])
def test_a_flipped_bit_in_a_saved_weight_is_refused_at_fit_naming_the_file(tmp_path, marker, digest):
    # By default too (no digest): the CRC-32 torch stores with every record, which torch.load does not check.
    callback = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=2)
    _fit(tmp_path, [AtomicCheckpointIO(digest=True)] if digest else [], callbacks=[callback])
    (saved,) = (tmp_path / "ckpt").iterdir()
    _flip_a_bit_in_the_weight(saved)
    torch.load(saved, weights_only=True)  # torch itself does not notice
    with pytest.raises(DamagedCheckpointError) as info:
        _fit(tmp_path / "resumed", ckpt_path=saved)
    assert re.fullmatch(
        rf"{re.escape(str(saved))}: a damaged or truncated checkpoint \(\d+ bytes; the bytes of `[^`]+/data/\d+` do"
        r" not match the CRC-32 stored with them \(flipped or overwritten bytes\)\)",
        str(info.value),
    ), str(info.value)
    if digest:  # without the checksums the digest catches it
        with pytest.raises(DamagedCheckpointError, match="do not match its digest in 'state_dict'"):
            AtomicCheckpointIO(verify_checksums=False).load_checkpoint(saved)


def test_a_changed_tensor_under_the_old_digest_is_refused_and_the_report_says_the_same(tmp_path, saved, capsys):
    checkpoint = torch.load(saved, weights_only=True)
    weight = next(iter(checkpoint["state_dict"].values()))
    weight.view(-1).view(torch.int32)[0] ^= 1  # one flipped bit, saved again with plain torch under the old digest
    torch.save(checkpoint, saved)
    with pytest.raises(DamagedCheckpointError) as info:
        AtomicCheckpointIO().load_checkpoint(saved)
    assert str(info.value) == (
        f"{saved}: a damaged checkpoint: its contents do not match its digest in 'state_dict' (flipped or overwritten"
        " bytes)"
    )
    assert cli.main(["report", str(saved)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"lightning-determinism: error: {info.value}"]


def test_a_truncated_checkpoint_is_refused_once_in_the_main_process_before_the_launch(tmp_path, saved, marker):
    data = saved.read_bytes()
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(data[: len(data) // 2])  # what a save killed half-way by Lightning's own plugin leaves
    strategy = DeterministicDDPStrategy(seed=1, start_method="fork")
    marker.unlink(missing_ok=True)
    with pytest.raises(DamagedCheckpointError) as info:  # not a rank's ProcessRaisedException
        _fit(tmp_path / "resumed", ckpt_path=cut, strategy=strategy, devices=2)
    assert str(info.value).startswith(
        f"`ckpt_path`: {cut}: a damaged or truncated checkpoint ({len(data) // 2} bytes; the zip archive's central"
        " directory, written last, is missing or damaged"
    )
    assert not marker.exists()  # no rank was started


def test_a_damaged_file_at_load_is_one_error_naming_it_and_its_size(tmp_path):
    path = tmp_path / "step=4.ckpt"
    AtomicCheckpointIO().save_checkpoint(_checkpoint(), path)
    data = path.read_bytes()
    path.write_bytes(data[:2000])
    with pytest.raises(DamagedCheckpointError) as info:
        AtomicCheckpointIO().load_checkpoint(path)
    assert str(info.value) == (
        f"{path}: a damaged or truncated checkpoint (2000 bytes; torch.load: PytorchStreamReader failed reading zip"
        " archive: failed finding central directory)"
    )
    assert info.value.__cause__ is None and info.value.__suppress_context__
    path.write_bytes(b"")
    with pytest.raises(DamagedCheckpointError, match=r"an empty file \(0 bytes\)"):
        AtomicCheckpointIO().load_checkpoint(path)


def test_a_file_refused_for_another_reason_keeps_torchs_error(tmp_path):
    import numpy as np

    path = tmp_path / "numpy.ckpt"
    torch.save({"weights": np.zeros(2)}, path)
    with pytest.raises(Exception, match="Unsupported global") as info:
        AtomicCheckpointIO().load_checkpoint(path, weights_only=True)
    assert not isinstance(info.value, DamagedCheckpointError)
    assert AtomicCheckpointIO().load_checkpoint(path, weights_only=False)["weights"].tolist() == [0.0, 0.0]


def test_a_checkpoint_without_a_digest_loads_unchecked(tmp_path):
    path = tmp_path / "stock.ckpt"
    TorchCheckpointIO().save_checkpoint(_checkpoint(), path)
    assert torch.equal(AtomicCheckpointIO().load_checkpoint(path)["state_dict"]["w"], _checkpoint()["state_dict"]["w"])
    AtomicCheckpointIO(digest=False).save_checkpoint(_checkpoint(), path)
    assert DIGEST_KEY not in torch.load(path, weights_only=True)


def test_the_digest_survives_a_save_and_a_load_of_every_kind_of_entry(tmp_path):
    torch.manual_seed(0)
    base = torch.randn(4, 6)
    checkpoint = {
        "tensors": [base.t(), base[1:3, ::2], torch.tensor(2.5), torch.zeros(0), base.to(torch.bfloat16)],
        "flags": torch.tensor([True, False]),
        "ints": {0: 1, 2**70: -3, "x": (1, 2.0, None, "s", b"b", float("nan"), -0.0)},
        "set": {"alpha", "beta", "gamma"},
        "complex": torch.randn(3, dtype=torch.complex64).conj(),
    }
    path = tmp_path / "kinds.ckpt"
    AtomicCheckpointIO(digest=True).save_checkpoint(checkpoint, path)
    loaded = AtomicCheckpointIO().load_checkpoint(path, weights_only=False)  # checked: no false alarm
    assert checkpoint_digest(loaded) == checkpoint_digest(checkpoint)
    loaded["ints"]["x"] = (1, 2.0, None, "s", b"b", float("nan"), 0.0)  # -0.0 and 0.0 differ by a bit
    assert checkpoint_digest(loaded)["value"] != checkpoint_digest(checkpoint)["value"]


def test_remote_paths_go_through_lightnings_own_code():
    pytest.importorskip("fsspec")
    io = AtomicCheckpointIO(digest=True)
    io.save_checkpoint(_checkpoint(), "memory://ldet-test/a.ckpt")
    loaded = io.load_checkpoint("memory://ldet-test/a.ckpt")
    assert DIGEST_KEY not in loaded and loaded["epoch"] == 1


def test_the_check_before_the_launch_passes_what_it_cannot_judge(tmp_path):
    strategy = DeterministicDDPStrategy(start_method="fork")
    for path in (None, "last", "best", "hpc", "registry:model", "s3://bucket/a.ckpt", tmp_path):
        check_resume_path(strategy, path)
    json_file = tmp_path / "not-torch.json"
    json_file.write_text("{}")
    check_resume_path(strategy, json_file)  # not a torch file: torch.load says so in the rank
    with pytest.raises(FileNotFoundError, match=r"^`ckpt_path`: .*missing.ckpt: no such checkpoint file$"):
        check_resume_path(strategy, tmp_path / "missing.ckpt")
    # A plugin of the user's own (another format) reads what it likes: not checked.
    check_resume_path(DeterministicDDPStrategy(start_method="fork", checkpoint_io=_ForeignIO()), tmp_path / "x")
    (tmp_path / "empty.ckpt").write_bytes(b"")
    with pytest.raises(DamagedCheckpointError, match="an empty file"):
        check_checkpoint_file(tmp_path / "empty.ckpt")


@pytest.mark.parametrize("damage", ["a shard deleted", "a shard cut short", "the index deleted"])
def test_a_damaged_distributed_checkpoint_is_refused_by_report_and_before_launch(tmp_path, damage, capsys):
    from _lightning_determinism_cli import main
    from lightning_determinism import DeterministicModelParallelStrategy
    from lightning_determinism.checkpoints.file import DamagedCheckpointError
    from lightning_determinism.checkpoints.io import check_resume_path
    from tests.divergence.test_diagnose import _distributed_checkpoint

    path = _distributed_checkpoint(tmp_path / "step=4.ckpt", 4, torch.ones(3, 2))
    assert main(["report", str(path)]) == 0  # whole: reported
    shard = next(path.glob("*.distcp"))
    if damage == "a shard deleted":
        shard.unlink()
        expected = f"the shard file {shard.name} that .metadata names is missing"
    elif damage == "a shard cut short":
        shard.write_bytes(shard.read_bytes()[:-5])
        expected = f"the shard file {shard.name} is cut short"
    else:
        (path / ".metadata").unlink()
        expected = "no .metadata"
    capsys.readouterr()
    assert main(["report", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err
    with pytest.raises(DamagedCheckpointError, match=f"`ckpt_path`: .*{re.escape(expected)}"):
        check_resume_path(DeterministicModelParallelStrategy(), path)


def test_a_save_killed_midway_leaves_no_file_lightnings_hpc_numbering_reads_as_a_version(tmp_path):
    # SLURM's SIGUSR1 path saves hpc_ckpt_N.ckpt; a SIGKILL during the save leaves the hidden temporary behind.
    # Lightning reads the digits of every name holding "hpc_ckpt_" (resume) or "ckpt_" (the next save's number) as a
    # version.
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    from lightning_determinism.checkpoints.atomic import temporary_name

    (tmp_path / "hpc_ckpt_1.ckpt").write_bytes(b"whole")
    (tmp_path / temporary_name("hpc_ckpt_2.ckpt")).write_bytes(b"cut short")  # what the kill leaves
    versions = _CheckpointConnector._CheckpointConnector__max_ckpt_version_in_folder  # Lightning's own parser
    assert versions(tmp_path, "hpc_ckpt_") == 1  # the auto-resume loads hpc_ckpt_1.ckpt
    assert _CheckpointConnector.hpc_save_path(tmp_path) == str(tmp_path / "hpc_ckpt_2.ckpt")  # and saves the next
