"""A strategy's distributed save, published whole: the ranks write under a hidden name, rank 0 renames it into place.

:func:`save_published` wraps the ``save_checkpoint`` of Lightning's (and Fabric's) ``ModelParallelStrategy`` when it
writes a distributed checkpoint directory (:mod:`~lightning_determinism.checkpoints.publish` says how and why);
:func:`check_before_load` is what every rank checks before it loads one.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lightning_determinism._compat.access import extra_distributed_entries
from lightning_determinism._process import distributed
from lightning_determinism.checkpoints.distributed import META, check_distributed_checkpoint
from lightning_determinism.checkpoints.file import DamagedCheckpointError, verify_checksums
from lightning_determinism.checkpoints.publish import (
    finish_interrupted_publish,
    hidden_path,
    new_token,
    publish,
    shard_entries,
    write_mark,
)
from lightning_determinism.checkpoints.shard_digests import INDEX_NAME, SHARD_SUFFIX, shard_digests
from lightning_determinism.seeding.rank_states import all_gather


def save_published(strategy: Any, path: Any, write: Callable[[Path], None], step: int | None) -> None:
    """Run ``write(hidden)`` (Lightning's distributed save) on every rank, then publish ``hidden`` under ``path``.

    The ranks agree on the outcome (one gather after the write, one broadcast after the publish, in place of
    barriers): a failure of any rank (a full disk on one node, rank 0's ``meta.pt``) is the same one-line error on
    every rank, the hidden directory is removed, and the final name keeps the previous checkpoint.

    Args:
        strategy: the strategy saving (its ``broadcast``, ``global_rank`` and ``world_size``).
        path: the checkpoint's final name (rank 0's is taken, as Lightning does).
        write: writes the checkpoint directory to the path it is given (the base class's ``save_checkpoint``).
        step: the global step saved, recorded in the mark (``None`` where there is none: Fabric).

    Raises:
        OSError: on every rank, what the filesystem said to the rank that failed (``ENOSPC``: a full disk), in one
            line naming the checkpoint, the rank and the file; the previous checkpoint is whole.
        RuntimeError: the same for a failure that is not the filesystem's.
    """
    final = Path(strategy.broadcast(os.fspath(path)))
    token: str = strategy.broadcast(new_token())
    rank, world_size = int(strategy.global_rank), int(strategy.world_size)
    hidden = hidden_path(final, token)
    if rank == 0:
        finish_interrupted_publish(final)  # a kill between the two renames of the previous publish
    failure: _Failure | None = None
    digests: dict[str, tuple[int, int]] = {}
    try:
        with extra_distributed_entries(shard_entries(token, rank)):
            write(hidden)
        digests = shard_digests(hidden, rank)
    except (Exception, _dcp_exception()) as err:  # DCP's CheckpointException derives from BaseException
        failure = _failure(err, rank, hidden)
    outcomes = all_gather((failure, digests))  # every rank has written (or failed): in place of a barrier
    failed = next((outcome[0] for outcome in outcomes if outcome[0] is not None), None)
    if failed is None and rank == 0:
        try:
            write_mark(hidden, token, world_size, step, {k: v for _, d in outcomes for k, v in d.items()})
        except Exception as err:  # noqa: BLE001  (said by every rank: the others wait for rank 0's word)
            failed = _failure(err, rank, hidden)
    if rank == 0 and failed is not None:
        shutil.rmtree(hidden, ignore_errors=True)  # the space a full disk needs back; the final name was untouched
    elif rank == 0:
        try:
            publish(hidden, final)
        except Exception as err:  # noqa: BLE001  (the renames: both checkpoints are kept, settled before a resume)
            failed = _failure(err, rank, hidden)
            failed.published = False
    failed = strategy.broadcast(failed if rank == 0 else None)  # no rank reads or saves before it is in place
    if failed is not None:
        failed.raise_for(final, rank)


def _dcp_exception() -> type[BaseException]:
    from torch.distributed.checkpoint import CheckpointException

    return CheckpointException


class _Failure:
    """What went wrong on which rank, sent to the others (picklable: no traceback, no exception object)."""

    def __init__(self, rank: int, errno: int | None, what: str, where: str) -> None:
        self.rank, self.errno, self.what, self.where = rank, errno, what, where
        self.published: bool | None = None  # False: the publish's renames failed (None: before them)

    def raise_for(self, final: Path, rank: int) -> None:
        if self.published is False:
            said = (
                f"[rank: {rank}] publishing the distributed save of {final} failed on rank 0: {self.what}; both"
                " checkpoints are kept, the complete one is put in place before the next resume or save"
            )
        else:
            said = (
                f"[rank: {rank}] the distributed save of {final} failed on rank {self.rank}{self.where}: {self.what};"
                f" nothing was published: {final.name} is the previous checkpoint, whole"
            )
        if self.errno is not None:
            raise OSError(self.errno, said)
        raise RuntimeError(said)


def _failure(err: BaseException, rank: int, hidden: Path) -> _Failure:
    """The first failure inside ``err`` (DCP wraps each rank's own), as one line naming the file where known."""
    failures = getattr(err, "failures", None)
    in_dcp = isinstance(failures, dict) and bool(failures)
    if in_dcp:  # DCP's CheckpointException: {rank: (exception, traceback)}
        rank, wrapped = min(failures.items(), key=lambda item: item[0])  # type: ignore[union-attr]
        err = wrapped[0] if isinstance(wrapped, tuple) else wrapped
    filename = getattr(err, "filename", None)
    if filename:
        where = f" writing {Path(os.fspath(filename)).name}"
    elif in_dcp:
        where = f" writing its shard files (__{rank}_*{SHARD_SUFFIX})" + (f" or {INDEX_NAME}" if rank == 0 else "")
    elif rank == 0:  # after DCP's save returned everywhere: Lightning's torch.save of rank 0's part
        where = f" writing {META}"
    else:
        where = ""
    if isinstance(err, OSError) and err.errno is not None:
        return _Failure(rank, err.errno, err.strerror or os.strerror(err.errno), where)
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    said = lines[-1] if lines else ""  # torch's C++ errors end with what went wrong ("unexpected pos 832 vs 726")
    if "unexpected pos" in said or "file write failed" in said:
        said += " (torch's zip writer: a full disk, or the file cut off under it)"
    return _Failure(rank, None, f"{type(err).__name__}: {said}", where)


def check_before_load(path: Any, rank: int | None = None) -> None:
    """Every rank, before it loads a distributed checkpoint directory: its files are there, whole and of one save.

    On several processes the ranks share the reading of the shard files' CRC-32s (each its share) and agree in one
    gather: every rank refuses, with the same line, or none does. A local single file (``save_distributed_checkpoint
    =False``) has its records checked against the CRC-32s torch stored with them; a remote URL passes (loaded as
    Lightning does).

    Raises:
        DamagedCheckpointError: naming the directory and what is wrong, with the rank in front when given.
    """
    text = os.fspath(path)
    local = "://" not in text
    share = (dist.get_rank(), dist.get_world_size()) if distributed() else (0, 1)
    message = None
    try:
        if local and os.path.isdir(text):
            check_distributed_checkpoint(text, share)
        elif local and os.path.isfile(text):
            verify_checksums(text)  # torch.load never checks them: a flipped bit would load
    except DamagedCheckpointError as err:
        message = str(err)
    if distributed():
        message = next((found for found in all_gather(message) if found is not None), None)
    if message is not None:
        raise DamagedCheckpointError(f"[rank: {rank}] {message}" if rank is not None else message)


__all__ = ["check_before_load", "save_published"]
