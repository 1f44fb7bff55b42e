"""AtomicCheckpointIO: Lightning's ``TorchCheckpointIO``, writing where the checkpoint lives, whole or not at all.

Lightning's save serialises the checkpoint into memory and writes it through a temporary file in ``TMPDIR``, which
is moved onto the final name: a copy, not a rename, when the checkpoint directory is on another filesystem (a local
``/tmp``, checkpoints on NFS or Lustre). A ``SIGKILL`` or a full disk during that copy leaves the checkpoint cut
short (a fixed name such as ``preempted.ckpt`` loses the previous good one) and a temporary file in ``TMPDIR``; the
resumed run then fails on every rank with ``failed finding central directory``, naming no file.

:class:`AtomicCheckpointIO` writes a local checkpoint with
:func:`~lightning_determinism.checkpoints.atomic.write_atomically` (a hidden temporary file in the checkpoint's
directory, synced, renamed onto the final name; on failure the previous file is untouched and the temporary file
removed), and optionally records a digest of what it holds (:mod:`~lightning_determinism.checkpoints.integrity`),
checked when it is loaded. A damaged file is one :class:`~lightning_determinism.checkpoints.file.DamagedCheckpointError`
naming the file, its size and what is wrong. Remote paths (fsspec URLs: ``s3://``, ``gs://``, ...) are saved by
Lightning's own code, as before.

The deterministic strategies use it unless given a ``CheckpointIO`` of the user's own
(:class:`AtomicCheckpointIOMixin`), so ``ModelCheckpoint``'s files, ``trainer.save_checkpoint`` and ``fabric.save``
go through it. Strategies that save and load in their own way (FSDP, ``ModelParallelStrategy``, DeepSpeed) are left
as they are.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.fabric.strategies import Strategy as FabricStrategy
from lightning.fabric.utilities.rank_zero import rank_prefixed_message
from lightning.pytorch.strategies import Strategy as TrainerStrategy
from typing_extensions import override

from lightning_determinism._process import distributed
from lightning_determinism.checkpoints.atomic import write_atomically
from lightning_determinism.checkpoints.distributed import INDEX, META, check_distributed_checkpoint
from lightning_determinism.checkpoints.file import (
    DamagedCheckpointError,
    check_checkpoint_file,
    load_failure_message,
    verify_checksums,
)
from lightning_determinism.checkpoints.integrity import verify_digest, with_digest
from lightning_determinism.checkpoints.publish import finish_interrupted_publish, finish_interrupted_publishes
from lightning_determinism.errors import DeterminismWarning

DIGEST_BY_DEFAULT = False
"""Whether :class:`AtomicCheckpointIO` records a digest unless told: it costs more than a tenth of a save and of a load
(docs/preemption.md has the figures), so it is asked for with ``AtomicCheckpointIO(digest=True)``."""

# Lightning's names for checkpoints it finds itself (`Trainer.fit(ckpt_path="last")`); the ranks resolve them.
_SPECIAL_PATHS = ("last", "best", "hpc")


def local_path(path: Any) -> str | None:
    """The local file a checkpoint path names (a plain path or a ``file://`` URL); ``None`` for a remote URL.

    Examples:
        >>> local_path("/ckpt/step=4.ckpt"), local_path("file:///ckpt/a.ckpt"), local_path("s3://bucket/a.ckpt")
        ('/ckpt/step=4.ckpt', '/ckpt/a.ckpt', None)
    """
    text = os.fspath(path)
    text = text.decode() if isinstance(text, bytes) else text
    if text.startswith("file://"):
        return text[len("file://") :]
    return None if "://" in text or "::" in text else text


def _ranked(message: str) -> str:
    """The message with this process's rank in front when several ranks run (each one loads the checkpoint)."""
    if distributed():
        return rank_prefixed_message(message, dist.get_rank())
    return message


class AtomicCheckpointIO(TorchCheckpointIO):
    """Saves checkpoints atomically where they live and, with ``digest=True``, checks on load what they hold.

    Remote paths (fsspec URLs: ``s3://``, ``gs://``, ...) are saved and loaded by ``TorchCheckpointIO`` itself; a
    digest recorded in a checkpoint is checked wherever it was loaded from.

    Args:
        digest: record a SHA-256 digest of the checkpoint's contents under ``"lightning_determinism_digest"``
            (checked whenever a checkpoint that has one is loaded, whatever this flag says). Off by default: it costs
            more than a tenth of the save and of the load (docs/preemption.md).
        verify_checksums: before loading a local zip checkpoint (torch's format, Lightning's stock files too), check
            every record against the CRC-32 torch stored with it, which ``torch.load`` does not: a flipped bit in a
            weight is refused instead of loaded. On by default: it reads the file once more (about 3 GB/s), and costs
            nothing at save time.

    Raises:
        TypeError: if ``digest`` or ``verify_checksums`` is not a bool.

    Examples:
        >>> import pathlib, tempfile, torch
        >>> _ = torch.manual_seed(0)
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "step=4.ckpt"
        >>> io = AtomicCheckpointIO(digest=True)
        >>> io.save_checkpoint({"state_dict": {"w": torch.randn(3)}}, path)
        >>> sorted(io.load_checkpoint(path))  # the digest checked, and removed
        ['state_dict']
        >>> sorted(p.name for p in path.parent.iterdir())  # no temporary file left beside it
        ['step=4.ckpt']
    """

    def __init__(self, digest: bool = DIGEST_BY_DEFAULT, verify_checksums: bool = True) -> None:
        for name, value in (("digest", digest), ("verify_checksums", verify_checksums)):
            if not isinstance(value, bool):
                raise TypeError(f"`{name}` must be a bool, got {value!r}")
        super().__init__()
        self.digest = digest
        self.verify_checksums = verify_checksums

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Write the checkpoint to ``path`` atomically (a local path), or as Lightning does (a remote URL).

        Raises:
            TypeError: if ``storage_options`` is given, as ``TorchCheckpointIO`` does.
            OSError: what the filesystem said (a full disk: ``ENOSPC``); the previous file under ``path`` is intact.
        """
        local = local_path(path)
        if local is None or storage_options is not None:
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        contents = with_digest(checkpoint) if self.digest and isinstance(checkpoint, dict) else checkpoint
        write_atomically(local, lambda file: torch.save(contents, file))

    @override
    def load_checkpoint(
        self,
        path: Any,
        map_location: Callable | None = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load a checkpoint, and check it against its digest when it has one.

        Raises:
            FileNotFoundError: if there is no such file.
            DamagedCheckpointError: if the file is cut short or damaged, or does not match its digest: one line
                naming the file, its size and what is wrong (with the rank in front where several ranks load it).
        """
        local = local_path(path)
        if local is None:
            # Lightning 2.5 has no `weights_only` here.
            extra = {} if weights_only is None else {"weights_only": weights_only}
            checkpoint = super().load_checkpoint(path, map_location, **extra)
        else:
            if not os.path.exists(local):
                raise FileNotFoundError(f"Checkpoint file not found: {path}")  # Lightning's words
            if self.verify_checksums:
                try:
                    verify_checksums(local)
                except DamagedCheckpointError as err:
                    raise DamagedCheckpointError(_ranked(str(err))) from None
            try:
                checkpoint = torch.load(local, map_location=map_location, weights_only=weights_only)  # type: ignore[arg-type]
            except Exception as err:  # noqa: BLE001  (any failure of a damaged file; others are raised as they came)
                message = load_failure_message(local, err)
                if message is None:
                    raise
                raise DamagedCheckpointError(_ranked(message)) from None
        if isinstance(checkpoint, dict):
            try:
                verify_digest(path, checkpoint)
            except DamagedCheckpointError as err:
                raise DamagedCheckpointError(_ranked(str(err))) from None
        return checkpoint


def _lightnings(cls: type, name: str) -> Any:
    """``cls``'s method ``name`` as Lightning's classes define it (ours only wrap it: they are skipped)."""
    for klass in cls.__mro__:
        if name in vars(klass) and not klass.__module__.startswith("lightning_determinism."):
            return vars(klass)[name]
    return None


def _uses_checkpoint_io(strategy: Any) -> bool:
    """Whether the strategy saves and loads through its ``checkpoint_io`` (DDP, single device), as the base does.

    A strategy that writes its single-file checkpoints through it, but saves and loads otherwise in its own way (the
    model-parallel one with ``save_distributed_checkpoint=False``), says so with ``_ldet_file_saves_through_io``.
    """
    if getattr(strategy, "_ldet_file_saves_through_io", False):
        return True
    for base in (TrainerStrategy, FabricStrategy):
        if isinstance(strategy, base):
            return all(
                _lightnings(type(strategy), name) is vars(base)[name] for name in ("save_checkpoint", "load_checkpoint")
            )
    return False


class AtomicCheckpointIOMixin:
    """Gives a Lightning or Fabric strategy an :class:`AtomicCheckpointIO` in place of Lightning's default.

    Mixed into the deterministic strategies. A ``CheckpointIO`` of the user's own (``Trainer(plugins=[...])``, the
    strategy's ``checkpoint_io=``, a wrapper such as ``AsyncCheckpointIO``) is kept as it is; none, or a plain
    ``TorchCheckpointIO``, is replaced. Strategies that save and load without their ``checkpoint_io`` (FSDP,
    ``ModelParallelStrategy``, DeepSpeed) are left alone.

    Examples:
        >>> from lightning_determinism import DeterministicDDPStrategy
        >>> type(DeterministicDDPStrategy(seed=1).checkpoint_io).__name__
        'AtomicCheckpointIO'
    """

    _checkpoint_io: CheckpointIO | None

    def _ldet_base_checkpoint_io(self) -> property:
        """The ``checkpoint_io`` property of the strategy this mixin is combined with."""
        mro = type(self).__mro__
        for cls in mro[mro.index(AtomicCheckpointIOMixin) + 1 :]:
            if isinstance(vars(cls).get("checkpoint_io"), property):
                return vars(cls)["checkpoint_io"]  # type: ignore[no-any-return]
        raise TypeError(f"{type(self).__name__} mixes in AtomicCheckpointIOMixin without a strategy to add it to")

    @property
    def checkpoint_io(self) -> CheckpointIO:
        """The strategy's ``CheckpointIO``: an :class:`AtomicCheckpointIO` unless the user gave one of their own."""
        current = self._checkpoint_io
        if (current is None or type(current) is TorchCheckpointIO) and _uses_checkpoint_io(self):
            self._checkpoint_io = AtomicCheckpointIO()
        return self._ldet_base_checkpoint_io().__get__(self, type(self))  # type: ignore[no-any-return]

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO) -> None:
        self._ldet_base_checkpoint_io().__set__(self, io)


def _looks_distributed(path: str) -> bool:
    """A directory with any part of a distributed checkpoint: rank 0's ``meta.pt``, DCP's index or a shard."""
    if not os.path.isdir(path):
        return False
    return any(os.path.exists(os.path.join(path, name)) for name in (META, INDEX)) or any(
        name.endswith(".distcp") for name in os.listdir(path)
    )


def _finish_publish(path: str) -> None:
    message = finish_interrupted_publish(path)
    if message is not None:
        warnings.warn(message, DeterminismWarning, stacklevel=3)


def finish_interrupted_publishes_of(trainer: Any) -> None:
    """Before a resume from ``"last"``: settle the distributed saves a kill cut short in every checkpoint directory.

    Only where the final name went missing between the two renames of a publish
    (:func:`~lightning_determinism.checkpoints.publish.finish_interrupted_publish`); each one is said in a warning.
    """
    for callback in getattr(trainer, "checkpoint_callbacks", None) or []:
        directory = local_path(getattr(callback, "dirpath", None) or "")
        if directory and os.path.isdir(directory):
            for message in finish_interrupted_publishes(directory):
                warnings.warn(message, DeterminismWarning, stacklevel=2)


def check_resume_path(strategy: Any, ckpt_path: Any) -> None:
    """The cheap check of a ``ckpt_path`` in the main process, before the ranks exist: one error instead of one a rank.

    Only local files read by a ``TorchCheckpointIO`` (ours included) are checked
    (:func:`~lightning_determinism.checkpoints.file.check_checkpoint_file`: it exists, can be read, its zip
    directory is whole); ``"last"``, ``"best"``, ``"hpc"``, the model registry, remote URLs and a plugin of the user's
    own pass. The digest is checked later, when each rank loads the file.

    Args:
        strategy: the strategy that will load the checkpoint (its ``checkpoint_io`` says how).
        ckpt_path: what ``trainer.fit(ckpt_path=...)`` (or ``validate``, ``test``, ``predict``) was given.

    Raises:
        FileNotFoundError: if there is no such file.
        PermissionError: if it cannot be read.
        DamagedCheckpointError: if it is empty or cut short.

    Examples:
        >>> from lightning_determinism import DeterministicDDPStrategy
        >>> check_resume_path(DeterministicDDPStrategy(), "last")  # resolved by the ranks: passes
        >>> check_resume_path(DeterministicDDPStrategy(), "missing.ckpt")
        Traceback (most recent call last):
        ...
        FileNotFoundError: `ckpt_path`: missing.ckpt: no such checkpoint file
    """
    if not isinstance(ckpt_path, (str, os.PathLike)):
        return
    text = os.fspath(ckpt_path)
    if text in _SPECIAL_PATHS or text.lower() == "registry" or text.lower().startswith("registry:"):
        return
    local = local_path(text)
    try:
        io = strategy.checkpoint_io
    except (AttributeError, NotImplementedError):  # Fabric's FSDP has none
        return
    if local is not None and not os.path.lexists(local):
        _finish_publish(local)  # a kill between the two renames of a distributed save: the complete one put in place
    if local is not None and _looks_distributed(local):  # a distributed checkpoint (ModelParallelStrategy, FSDP)
        try:
            check_distributed_checkpoint(local)
        except DamagedCheckpointError as err:
            raise DamagedCheckpointError(f"`ckpt_path`: {err}") from None
        return
    if local is None or not isinstance(io, TorchCheckpointIO):
        return
    try:
        check_checkpoint_file(local)
    except OSError as err:
        raise type(err)(f"`ckpt_path`: {err}") from None
    except DamagedCheckpointError as err:
        raise DamagedCheckpointError(f"`ckpt_path`: {err}") from None


__all__ = [
    "DIGEST_BY_DEFAULT",
    "AtomicCheckpointIO",
    "AtomicCheckpointIOMixin",
    "check_resume_path",
    "finish_interrupted_publishes_of",
    "local_path",
]
