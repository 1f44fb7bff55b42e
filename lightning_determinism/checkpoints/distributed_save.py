"""A strategy's distributed save, published whole: the ranks write under a hidden name, rank 0 renames it into place.

:func:`save_published` wraps the ``save_checkpoint`` of Lightning's (and Fabric's) ``ModelParallelStrategy`` when it
writes a distributed checkpoint directory (:mod:`~lightning_determinism.checkpoints.publish` says how and why);
:func:`check_before_load` is what every rank checks before it loads one.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_determinism._compat.access import extra_distributed_entries
from lightning_determinism.checkpoints.distributed import check_distributed_checkpoint
from lightning_determinism.checkpoints.file import DamagedCheckpointError
from lightning_determinism.checkpoints.publish import (
    finish_interrupted_publish,
    hidden_path,
    new_token,
    publish,
    shard_entries,
    write_mark,
)


def save_published(strategy: Any, path: Any, write: Callable[[Path], None], step: int | None) -> None:
    """Run ``write(hidden)`` (Lightning's distributed save) on every rank, then publish ``hidden`` under ``path``.

    Args:
        strategy: the strategy saving (its ``broadcast``, ``barrier``, ``global_rank`` and ``world_size``).
        path: the checkpoint's final name (rank 0's is taken, as Lightning does).
        write: writes the checkpoint directory to the path it is given (the base class's ``save_checkpoint``).
        step: the global step saved, recorded in the mark (``None`` where there is none: Fabric).

    Raises:
        OSError: on rank 0, what the filesystem said when publishing; the final name keeps the previous checkpoint.
    """
    final = Path(strategy.broadcast(os.fspath(path)))
    token: str = strategy.broadcast(new_token())
    rank, world_size = int(strategy.global_rank), int(strategy.world_size)
    hidden = hidden_path(final, token)
    if rank == 0:
        finish_interrupted_publish(final)  # a kill between the two renames of the previous publish
    with extra_distributed_entries(shard_entries(token, rank)):
        write(hidden)
    if rank == 0:
        write_mark(hidden, token, world_size, step)
    strategy.barrier("ldet-distributed-save-written")
    try:
        if rank == 0:
            publish(hidden, final)
    finally:
        strategy.barrier("ldet-distributed-save-published")  # no rank reads or saves before it is in place


def check_before_load(path: Any, rank: int | None = None) -> None:
    """Every rank, before it loads a distributed checkpoint directory: its files are there and belong together.

    A path that is not a local directory passes (a single file, a remote URL: loaded as Lightning does).

    Raises:
        DamagedCheckpointError: naming the directory and what is wrong, with the rank in front when given.
    """
    text = os.fspath(path)
    if "://" in text or not os.path.isdir(text):
        return
    try:
        check_distributed_checkpoint(text)
    except DamagedCheckpointError as err:
        raise DamagedCheckpointError(f"[rank: {rank}] {err}" if rank is not None else str(err)) from None


__all__ = ["check_before_load", "save_published"]
