"""Distributed checkpoints: every shard file's CRC-32 recorded by its rank and checked before a load; a full disk.

Two forked gloo ranks save through :func:`save_published` (the function the model-parallel strategies wrap around
Lightning's DCP save) with Lightning's own ``_distributed_checkpoint_save``; a full disk is a writer patched to fail
as one does (``OSError(ENOSPC)`` from ``write``) at a known save, on a known rank.
"""

import errno
import json
import os
import shutil
import zlib
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystem

from lightning_determinism import DeterministicModelParallelStrategy
from lightning_determinism.checkpoints.distributed import check_distributed_checkpoint
from lightning_determinism.checkpoints.distributed_save import check_before_load, save_published
from lightning_determinism.checkpoints.file import DamagedCheckpointError
from lightning_determinism.checkpoints.io import check_resume_path
from lightning_determinism.checkpoints.publish import MARK
from lightning_determinism.errors import DeterminismWarning
from tests.helpers import run_distributed

pytestmark = pytest.mark.distributed


class _Ranks:
    """What ``save_published`` asks of a strategy, on the default process group."""

    def __init__(self) -> None:
        self.global_rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def broadcast(self, obj, src=0):
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def barrier(self, name=None):
        dist.barrier()


def _lightnings_save(step: int):
    """Lightning's distributed save of ``ModelParallelStrategy``: the shards by DCP, then rank 0's ``meta.pt``."""
    import lightning.pytorch.strategies.model_parallel as lightning_model_parallel

    def write(hidden: Path) -> None:
        hidden.mkdir(parents=True, exist_ok=True)
        rank = dist.get_rank()
        weights = {f"w{rank}": torch.arange(4096, dtype=torch.float32) + 1000 * rank + step}  # each rank its own
        lightning_model_parallel._distributed_checkpoint_save({"state_dict": weights}, hidden)
        if rank == 0:
            torch.save({"global_step": step}, hidden / "meta.pt")

    return write


@contextmanager
def _full_disk(when):
    """While open, a file ``when(name)`` picks cannot be written: ``write`` fails with ENOSPC, as on a full disk."""

    class Full:
        def __init__(self, stream):
            self.stream = stream

        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, name):
            return getattr(self.stream, name)

    original = FileSystem.create_stream

    @contextmanager
    def create_stream(self, path, mode):
        with original(self, path, mode) as stream:
            yield Full(stream) if "w" in mode and when(Path(path).name) else stream

    FileSystem.create_stream = create_stream
    try:
        yield
    finally:
        FileSystem.create_stream = original


def _saves(rank, world_size, root, full_on_rank, full_file):
    """Step 2 saved as last.ckpt; then step 4, during which ``full_on_rank`` finds the disk full."""
    final = root / "last.ckpt"
    save_published(_Ranks(), final, _lightnings_save(2), 2)
    try:
        if rank == full_on_rank:
            if full_file == "meta.pt":  # torch.save's own writer: the disk fills up under rank 0's meta.pt
                original_save = torch.save

                def full_meta(obj, f, *args, **kwargs):  # what torch's zip writer says when the disk is full
                    if str(f).endswith("meta.pt"):
                        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 832 vs 726")
                    return original_save(obj, f, *args, **kwargs)

                torch.save = full_meta
            with _full_disk(lambda name: name.endswith(".distcp") and full_file == "shard"):
                save_published(_Ranks(), final, _lightnings_save(4), 4)
        else:
            save_published(_Ranks(), final, _lightnings_save(4), 4)
    except (OSError, RuntimeError) as err:
        (root / f"error{rank}.txt").write_text(f"{type(err).__name__}: {err}")


@pytest.mark.parametrize(("rank", "file"), [(1, "shard"), (0, "meta.pt")], ids=["shard-of-rank-1", "meta-of-rank-0"])
def test_a_full_disk_during_a_save_is_one_line_on_every_rank_and_the_previous_checkpoint_stays(tmp_path, rank, file):
    out = tmp_path / "out"
    out.mkdir()
    run_distributed(_saves, tmp_path, out, rank, file)
    if file == "shard":  # a real ENOSPC from write(); torch.save of a path says it in its own words
        start, said = "OSError: [Errno 28] ", "writing its shard files (__1_*.distcp): No space left on device;"
    else:
        start, said = "RuntimeError: ", "writing meta.pt: RuntimeError: [enforce fail at inline_container.cc:664] ."
    for each in (0, 1):
        message = (out / f"error{each}.txt").read_text()
        assert "\n" not in message, message
        assert message.startswith(f"{start}[rank: {each}] the distributed save of {out / 'last.ckpt'} failed")
        assert f"on rank {rank} {said}" in message, message
        assert message.endswith("nothing was published: last.ckpt is the previous checkpoint, whole")
    check_distributed_checkpoint(out / "last.ckpt")  # whole, its CRCs included
    assert json.loads((out / "last.ckpt" / MARK).read_text())["global_step"] == 2
    assert sorted(os.listdir(out)) == ["error0.txt", "error1.txt", "last.ckpt"]  # the half-written save is gone


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("digests")
    run_distributed(lambda rank, world_size: save_published(_Ranks(), root / "step=4.ckpt", _lightnings_save(4), 4),
                    root)  # fmt: skip
    return root / "step=4.ckpt"


def _flipped(saved: Path, tmp_path: Path, name: str) -> Path:
    target = tmp_path / "step=4.ckpt"
    shutil.copytree(saved, target)
    data = bytearray((target / name).read_bytes())
    data[len(data) // 2] ^= 0x10  # one bit, in the middle of the weights
    (target / name).write_bytes(bytes(data))
    return target


def test_every_shard_file_is_recorded_with_its_size_and_crc(saved):
    shards = json.loads((saved / MARK).read_text())["shards"]
    assert sorted(shards) == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # DCP's index too
    for name, (size, crc) in shards.items():
        data = (saved / name).read_bytes()
        assert size == len(data) and crc == zlib.crc32(data)


@pytest.mark.parametrize(
    ("name", "what"), [("__1_0.distcp", "the shard file __1_0.distcp"), (".metadata", "its index")]
)
def test_a_flipped_bit_in_a_shard_is_refused_before_launch_in_one_line_naming_the_file(saved, tmp_path, name, what):
    target = _flipped(saved, tmp_path, name)
    if name != ".metadata":  # the index is checked before it is unpickled, whatever `share` says
        check_distributed_checkpoint(target, share=None)  # by sizes and marks it is whole: only the CRC tells
    with pytest.raises(DamagedCheckpointError) as info:
        check_resume_path(DeterministicModelParallelStrategy(), target)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"`ckpt_path`: {target}: a damaged distributed checkpoint: {what}")
    assert "does not match the CRC-32 its rank recorded when it wrote it" in message


def _check_on_ranks(rank, world_size, target, out):
    try:
        check_before_load(target, rank)
    except DamagedCheckpointError as err:
        (out / f"error{rank}.txt").write_text(str(err))


def test_at_load_the_ranks_share_the_reading_and_every_rank_refuses_a_flipped_bit(saved, tmp_path):
    target = _flipped(saved, tmp_path, "__0_0.distcp")  # read by rank 0 alone: rank 1 learns of it from rank 0
    run_distributed(_check_on_ranks, tmp_path, target, tmp_path)
    for rank in (0, 1):
        message = (tmp_path / f"error{rank}.txt").read_text()
        assert message.startswith(f"[rank: {rank}] {target}: a damaged distributed checkpoint: the shard file __0_0")


def test_without_distributed_checkpoints_the_one_file_is_written_atomically_and_checked_before_its_load(tmp_path):
    # save_distributed_checkpoint=False: rank 0 writes one file through the strategy's checkpoint_io (Lightning's
    # TorchCheckpointIO: a copy through TMPDIR, cut short by a kill or a full disk).
    from lightning_determinism import AtomicCheckpointIO

    strategy = DeterministicModelParallelStrategy(save_distributed_checkpoint=False)
    assert type(strategy.checkpoint_io) is AtomicCheckpointIO
    path = tmp_path / "step=4.ckpt"
    strategy.checkpoint_io.save_checkpoint({"state_dict": {"w": torch.arange(4096.0)}}, path)
    assert os.listdir(tmp_path) == ["step=4.ckpt"]
    check_before_load(path, 0)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(DamagedCheckpointError, match=r"^\[rank: 0\] .*step=4\.ckpt: a damaged or truncated checkpoint"):
        check_before_load(path, 0)


def _publish_fails(rank, world_size, root):
    """Step 2 saved; at step 4 rank 0's second rename fails (no RENAME_EXCHANGE: the old one already put aside)."""
    from lightning_determinism.checkpoints import publish as publish_module

    final = root / "last.ckpt"
    save_published(_Ranks(), final, _lightnings_save(2), 2)

    def rename(source, target):
        if Path(target) == final:  # the second rename: the new checkpoint into place
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        os.replace(source, target)

    publish_module._exchange, publish_module.os.rename = (lambda a, b: False), rename
    try:
        save_published(_Ranks(), final, _lightnings_save(4), 4)
    except OSError as err:
        (root / f"error{rank}.txt").write_text(str(err))


def test_a_publish_that_fails_between_its_renames_keeps_both_checkpoints_and_says_so(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    run_distributed(_publish_fails, tmp_path, out)
    for rank in (0, 1):
        message = (out / f"error{rank}.txt").read_text()
        assert message.startswith(f"[Errno 5] [rank: {rank}] publishing the distributed save of {out / 'last.ckpt'}")
        assert message.endswith(
            "both checkpoints are kept, the complete one is put in place before the next resume or save"
        )
    assert not (out / "last.ckpt").exists()  # between the renames: the new one is hidden beside the old one
    with pytest.warns(DeterminismWarning, match="a save was killed while publishing it; the new checkpoint"):
        check_resume_path(DeterministicModelParallelStrategy(), out / "last.ckpt")
    assert json.loads((out / "last.ckpt" / MARK).read_text())["global_step"] == 4
