"""One checkpoint for every rank: ``ckpt_path="last"`` (and ``"hpc"``, SLURM's auto-resume) resolved once.

Lightning resolves ``fit(ckpt_path="last")`` in every rank: each lists its ``ModelCheckpoint`` directories and takes
the newest ``last*.ckpt`` it sees. Where that changes while the ranks look (a second run writing into the directory,
a straggler of a requeued job, node-local copies), the ranks load different checkpoints, or one loads none, and the
first collective of the restore (``RNGStateCheckpoint``'s gather) waits for the whole process-group timeout (30
minutes by default) before every rank prints its errors. Under the deterministic strategies:

1. before the launch, in the main process (fork, spawn, and the popen launcher's rank 0), ``"last"`` and ``"hpc"``
   are resolved once and the ranks are handed the path itself (:func:`resolve_before_launch`), which is then
   checked before any rank starts;
2. inside the ranks, a path Lightning would find on the filesystem (``"last"``, ``"hpc"``, and ``None`` under
   SLURM, where Lightning looks for an HPC checkpoint) is left to rank 0, which resolves it when the checkpoint is
   loaded and broadcasts it (``torchrun``, the popen launcher's child scripts); rank 0 first settles a publish a kill
   cut between its two renames (:func:`~lightning_determinism.checkpoints.publish.finish_interrupted_publish`), as
   the main process does before a launch;
3. before anything is loaded, the ranks compare what they are about to load, the path and the checkpoint's
   identity (:func:`checkpoint_identity`), in one collective: a difference is one ``RuntimeError`` on every rank,
   naming both.

The hooks are Lightning's ``_CheckpointConnector._parse_ckpt_path`` and ``resume_start`` (checked at import in
:mod:`~lightning_determinism._compat.checks`), wrapped once, the first time a deterministic strategy is made; they
act only for the strategies that ask for it (``_ldet_one_checkpoint``) and on more than one process.
"""

from __future__ import annotations

import functools
import json
import os
import warnings
import zlib
from collections.abc import Callable
from typing import Any

from lightning.fabric.plugins.environments import SLURMEnvironment

from lightning_determinism._compat.access import checkpoint_connector, ckpt_path_hooks, replace_ckpt_path_hooks
from lightning_determinism._process import distributed
from lightning_determinism.checkpoints.io import finish_interrupted_publishes_of, local_path
from lightning_determinism.checkpoints.publish import MARK, finish_interrupted_publish
from lightning_determinism.errors import DeterminismWarning
from lightning_determinism.seeding.rank_states import all_gather

FOUND_ON_DISK = ("last", "hpc")
"""The ``ckpt_path`` values Lightning resolves by looking at the filesystem (``None`` too, under SLURM)."""
_TAIL = 1 << 16  # a file's identity reads its last 64 KiB: a zip checkpoint's central directory, with every CRC
_PENDING = "_ldet_pending_ckpt_path"


def checkpoint_identity(path: Any) -> tuple[Any, ...] | None:
    """What tells two checkpoints apart cheaply: a distributed checkpoint's save token, a file's size and tail CRC.

    ``None`` for no path; a remote URL by its text alone; a directory without the save's mark by its ``meta.pt``'s
    size.

    Examples:
        >>> import pathlib, tempfile
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "last.ckpt"
        >>> _ = path.write_bytes(b"checkpoint")
        >>> checkpoint_identity(path)
        ('file', 10, 251721662)
        >>> checkpoint_identity(None) is None, checkpoint_identity("s3://bucket/last.ckpt")
        (True, ('remote',))
    """
    if path is None:
        return None
    local = local_path(path)
    if local is None:
        return ("remote",)
    try:
        if os.path.isdir(local):
            mark = os.path.join(local, MARK)
            if os.path.isfile(mark):
                with open(mark) as file:
                    return ("save", str(json.load(file).get("token")))
            meta = os.path.join(local, "meta.pt")
            return ("directory", os.path.getsize(meta) if os.path.isfile(meta) else None)
        with open(local, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            file.seek(max(0, size - _TAIL))
            return ("file", size, zlib.crc32(file.read()))
    except (OSError, ValueError):
        return ("missing",)


def _describe(entry: tuple[Any, Any]) -> str:
    path, identity = entry
    if path is None:
        return "none (no checkpoint found: it would start afresh)"
    if identity is None or identity[0] in ("remote", "missing"):
        return f"{path}" + (" (not there)" if identity and identity[0] == "missing" else "")
    if identity[0] == "save":
        return f"{path} (save {identity[1]})"
    if identity[0] == "file":
        return f"{path} ({identity[1]} bytes, tail CRC-32 {identity[2]:08x})"
    return f"{path} (meta.pt of {identity[1]} bytes)"


def agree_on_checkpoint(strategy: Any, path: Any, resolve: Callable[[], Any] | None) -> Any:
    """Every rank, before it loads a checkpoint: rank 0's choice, checked to be what every rank will load.

    Args:
        strategy: the strategy (its ``global_rank`` and ``broadcast``).
        path: the path this rank was given (a special name it left to rank 0, or a file).
        resolve: on a rank that left the choice to rank 0, how rank 0 resolves it (Lightning's own resolution).

    Returns:
        The path this rank loads (``None``: no checkpoint).

    Raises:
        RuntimeError: on every rank, one line naming the checkpoints of two ranks that differ.
    """
    rank = int(strategy.global_rank)
    choice: tuple[str, Any] | None = None
    if rank == 0:
        try:
            chosen = resolve() if resolve is not None else path
            _settle(chosen)
            choice = ("path", chosen)
        except Exception as err:  # noqa: BLE001  (said by every rank, not only rank 0: the others would wait)
            choice = ("error", f"{type(err).__name__}: {err}")
    choice = strategy.broadcast(choice, src=0)
    assert choice is not None
    if choice[0] == "error":
        raise RuntimeError(f"[rank: {rank}] resolving `ckpt_path` on rank 0 failed: {choice[1]}")
    mine = choice[1] if resolve is not None else path
    mine = None if mine is None else os.fspath(mine)
    seen = [tuple(entry) for entry in all_gather((mine, checkpoint_identity(mine)))]
    other = next((k for k, entry in enumerate(seen) if entry != seen[0]), None)
    if other is not None:
        raise RuntimeError(
            f"[rank: {rank}] the ranks would resume from different checkpoints: rank 0 from {_describe(seen[0])},"
            f" rank {other} from {_describe(seen[other])}; every rank must load the same one (give every rank the"
            ' same `ckpt_path`; "last" is resolved by rank 0 alone)'
        )
    return mine


def _settle(path: Any) -> None:
    """Rank 0: a checkpoint whose publish a kill cut between its two renames is put in place (the ranks load it)."""
    local = None if path is None else local_path(path)
    if local is not None and not os.path.lexists(local):
        message = finish_interrupted_publish(local)
        if message is not None:
            warnings.warn(message, DeterminismWarning, stacklevel=3)


def _agreeing(connector: Any) -> bool:
    strategy = getattr(getattr(connector, "trainer", None), "strategy", None)
    if not getattr(strategy, "_ldet_one_checkpoint", False):
        return False
    planned = getattr(strategy, "_ldet_planned_world_size", None)
    return bool(planned is not None and planned() > 1)


def _found_on_disk(ckpt_path: Any) -> bool:
    if ckpt_path is None:
        return SLURMEnvironment.detect()  # Lightning then looks for an HPC checkpoint
    return isinstance(ckpt_path, str) and ckpt_path in FOUND_ON_DISK


_originals: dict[str, Any] = {}


def install() -> None:
    """Wrap Lightning's resolution and loading of ``ckpt_path`` (idempotent; see the module's docstring)."""
    if _originals:
        return
    parse, resume = ckpt_path_hooks()
    _originals.update(parse=parse, resume=resume)

    @functools.wraps(parse)
    def parse_once(self: Any, state_fn: Any, ckpt_path: Any, model_provided: bool, model_connected: bool) -> Any:
        self.__dict__.pop(_PENDING, None)
        if _agreeing(self) and _found_on_disk(ckpt_path):
            setattr(self, _PENDING, (state_fn, ckpt_path, model_provided, model_connected))  # rank 0 resolves it
            return ckpt_path
        return parse(self, state_fn, ckpt_path, model_provided, model_connected)

    @functools.wraps(resume)
    def resume_agreed(self: Any, checkpoint_path: Any = None, *args: Any, **kwargs: Any) -> Any:
        # Lightning 2.5.0's resume_start takes the path alone; later ones also take weights_only: passed on as given.
        pending = self.__dict__.pop(_PENDING, None)
        resolve = None if pending is None else functools.partial(_resolve, parse, self, pending)
        if _agreeing(self) and distributed():
            checkpoint_path = agree_on_checkpoint(self.trainer.strategy, checkpoint_path, resolve)
        elif resolve is not None:
            checkpoint_path = resolve()
        return resume(self, checkpoint_path, *args, **kwargs)

    replace_ckpt_path_hooks(parse_once, resume_agreed)


def _resolve(parse: Any, connector: Any, pending: tuple[Any, ...]) -> Any:
    """Lightning's resolution, run by rank 0; ``"last"`` after the saves a kill cut short were settled."""
    if pending[1] == "last":
        finish_interrupted_publishes_of(connector.trainer)  # a kill between a publish's two renames: no last.ckpt
    return parse(connector, *pending)


def resolve_before_launch(trainer: Any, ckpt_path: Any) -> Any:
    """In the main process, before the ranks exist: ``"last"`` or ``"hpc"`` as the file Lightning would take.

    Anything else, or a special name that finds nothing, comes back as it was (the ranks then leave it to rank 0).
    Lightning's warnings are left to the rank that resolves it again.
    """
    if trainer is None or not _found_on_disk(ckpt_path) or ckpt_path is None:
        return ckpt_path
    connector = checkpoint_connector(trainer)
    parse = _originals.get("parse") or ckpt_path_hooks()[0]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            resolved = parse(connector, trainer.state.fn, ckpt_path, model_provided=True, model_connected=False)
    except (ValueError, OSError):  # "hpc" with none there: the rank says it, as before
        return ckpt_path
    return ckpt_path if resolved is None else resolved


__all__ = ["FOUND_ON_DISK", "agree_on_checkpoint", "checkpoint_identity", "install", "resolve_before_launch"]
