"""Lightning's distributed checkpoint directories, read whole on one process without a process group.

``ModelParallelStrategy`` (and ``FSDPStrategy(state_dict_type="sharded")``) saves a checkpoint as a directory
``step=K.ckpt/``: the shards of torch.distributed.checkpoint (DCP: ``__0_0.distcp``, ... and their index
``.metadata``, written once every shard is) hold the model's weights (``state_dict``; ``model`` under FSDP) and the
optimizers' states (``optimizer_0``, ...); rank 0's ``meta.pt``, written after them, holds the rest of the checkpoint
(loops, callbacks, LR schedulers, every rank's RNG states). :func:`load_distributed_checkpoint` reassembles the
full (unsharded) tensors on the CPU from the shards, whatever mesh wrote them, through DCP's public
``load(..., no_dist=True)``.

Reading the shards unpickles DCP's ``.metadata`` (as DCP's own load does); the non-tensor entries (the optimizers'
``param_groups``) and ``meta.pt`` are read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import functools
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from lightning_determinism.checkpoints.file import DamagedCheckpointError, load_failure_message
from lightning_determinism.checkpoints.publish import SHARD_MARK, check_save_parts
from lightning_determinism.checkpoints.shard_digests import verify_index_digest, verify_shard_digests

META = "meta.pt"  # Lightning's _METADATA_FILENAME: rank 0's part of the checkpoint
INDEX = ".metadata"  # DCP's index of the shards
_OPTIMIZER = re.compile(r"optimizer_(\d+)")


def check_distributed_checkpoint(path: str | Path, share: tuple[int, int] | None = (0, 1)) -> None:
    """The check of a distributed checkpoint directory before it is loaded: its files are there, whole and unchanged.

    Rank 0's ``meta.pt`` and DCP's ``.metadata`` exist, and every shard file the index names exists and holds at
    least the bytes the index places in it (a deleted or truncated shard is found here, not by each rank's load).
    Where the save marked its parts (:mod:`~lightning_determinism.checkpoints.publish`), they belong to one save, and
    every shard file has the size and CRC-32 its rank recorded (a flipped bit is refused instead of loaded).

    Args:
        path: the directory.
        share: ``(rank, world_size)``: which of the shard files' CRC-32s this process reads (every ``world_size``-th
            from the ``rank``-th: ranks share the reading at load); ``(0, 1)``: all; ``None``: only the index's.

    Raises:
        DamagedCheckpointError: naming the directory and the missing, cut short or changed file, or the part of
            another save.

    Examples:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "step=3.ckpt"
        >>> path.mkdir()
        >>> try:
        ...     check_distributed_checkpoint(path)
        ... except DamagedCheckpointError as err:
        ...     print(str(err).replace(str(path), "step=3.ckpt"))
        step=3.ckpt: a damaged distributed checkpoint: no .metadata (torch.distributed.checkpoint's index of the shards; a save cut short, or not a distributed checkpoint)
    """  # noqa: E501
    _checked_index(Path(path), share)


def _checked_index(path: Path, share: tuple[int, int] | None = (0, 1)) -> Any:
    """:func:`check_distributed_checkpoint`, returning the index it read (a load then need not unpickle it again)."""
    missing = {
        INDEX: "torch.distributed.checkpoint's index of the shards; a save cut short, or not a distributed checkpoint",
        META: "Lightning's rank 0 writes it after the shards; a save cut short, or not a Lightning checkpoint",
    }
    for name, why in missing.items():
        if not (path / name).is_file():
            raise DamagedCheckpointError(f"{path}: a damaged distributed checkpoint: no {name} ({why})")
    verify_index_digest(path)  # a flipped bit in the pickled index, before it is unpickled
    index = _read_index(path)
    mark = _check_shard_files(path, index)
    if mark is not None and share is not None:
        verify_shard_digests(path, mark, share)
    return index


def _read_index(path: Path) -> Any:
    """DCP's index of the shards (``.metadata``, a pickle), or one error naming the directory."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(path).read_metadata()
    except Exception as err:  # a pickle: anything may come of a damaged one
        raise DamagedCheckpointError(
            f"{path}: a damaged distributed checkpoint: its index {INDEX} cannot be read ({type(err).__name__}: {err})"
        ) from err


def _check_shard_files(path: Path, index: Any) -> dict[str, Any] | None:
    """Every shard file the index names is there and long enough for the bytes the index says it holds."""
    needed: dict[str, int] = {}
    for info in (index.storage_data or {}).values():
        name = str(getattr(info, "relative_path", ""))
        end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
        if name:
            needed[name] = max(needed.get(name, 0), end)
    for name, end in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            raise DamagedCheckpointError(
                f"{path}: a damaged distributed checkpoint: the shard file {name} that {INDEX} names is missing"
            )
        size = shard.stat().st_size
        if size < end:
            raise DamagedCheckpointError(
                f"{path}: a damaged distributed checkpoint: the shard file {name} is cut short ({size} bytes, its"
                f" index needs {end})"
            )
    return check_save_parts(path, index)  # shards, index and meta.pt of one save, not of two


@functools.cache
def _planner_class() -> type:
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from typing_extensions import override

    class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
        """DCP's default planner on a flat state dict, unpickling the non-tensor entries with ``weights_only``."""

        def __init__(self) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        @override
        def load_bytes(self, read_item: Any, value: Any) -> None:
            self.original_state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

    return WeightsOnlyLoadPlanner


def _unreadable(path: Path, err: BaseException) -> Exception:
    """What to raise for shards DCP could not read: damage, or a type ``weights_only`` refuses (as for a file)."""
    from torch.distributed.checkpoint import CheckpointException

    if isinstance(err, CheckpointException) and err.failures:
        err = next(iter(err.failures.values()))[0]  # the first rank's own error
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    refused = next((line for line in lines if "Unsupported global" in line), None)
    if refused is not None:  # no damage: torch's own type for a single-file checkpoint, naming the directory
        what = refused[refused.index("Unsupported global") :].split(". ")[0]
        return pickle.UnpicklingError(f"{path}: torch.load(weights_only=True) refuses an entry of its shards ({what})")
    if isinstance(err, (EOFError, pickle.UnpicklingError)):  # torch.load on a shard's bytes: they are not whole
        why = f"{type(err).__name__}: a shard file cut short or overwritten"
    else:
        why = f"{type(err).__name__}: {lines[0].split('. ')[0]}" if lines else type(err).__name__
    return DamagedCheckpointError(f"{path}: a damaged distributed checkpoint: its shards cannot be read ({why})")


def _read_shards(path: Path, index: Any) -> tuple[dict[str, Any], Any]:
    """The shards' entries by their flat DCP keys (``state_dict.net.0.weight``), tensors whole, on the CPU.

    Also returns DCP's record of each key's path in the saved state (``planner_data``).
    """
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(path)
    flat: dict[str, Any] = {}
    for key, stored in index.state_dict_metadata.items():
        # zeros, not empty: a chunk the index failed to list must not hash as whatever the memory held
        flat[key] = (
            torch.zeros(stored.size, dtype=stored.properties.dtype)
            if isinstance(stored, TensorStorageMetadata)
            else None
        )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # no_dist=True is the intent
        load(flat, storage_reader=reader, planner=_planner_class()(), no_dist=True)
    return flat, index.planner_data


def _nest(flat: dict[str, Any], mappings: Any) -> dict[str, Any]:
    """The flat entries nested again by DCP's own record of their paths (``planner_data``); lists become lists."""
    root: dict[Any, Any] = {}
    for key, value in flat.items():
        where = mappings.get(key) if isinstance(mappings, dict) else None
        keys = where if isinstance(where, tuple) and where else tuple(key.split(".", 1))
        node = root
        for part in keys[:-1]:
            node = node.setdefault(part, {})
        node[keys[-1]] = value
    return _lists(root)


def _lists(obj: Any) -> Any:
    if not isinstance(obj, dict):
        return obj
    items = {key: _lists(value) for key, value in obj.items()}
    if items and all(isinstance(key, int) for key in items) and sorted(items) == list(range(len(items))):
        return [items[i] for i in range(len(items))]
    return items


def _load_meta(path: Path) -> dict[str, Any]:
    try:
        meta = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        damaged = load_failure_message(path, err)
        if damaged is not None:
            raise DamagedCheckpointError(damaged) from err
        raise  # refused for another reason (weights_only): torch's message, as for a single-file checkpoint
    if not isinstance(meta, dict):
        raise DamagedCheckpointError(
            f"{path}: not a Lightning checkpoint's {META} (a {type(meta).__name__}, not a dict)"
        )
    return meta


def load_distributed_checkpoint(path: str | Path) -> dict[str, Any]:
    """A distributed checkpoint directory as one checkpoint dict, as a single ``.ckpt`` file's ``torch.load`` gives.

    Rank 0's ``meta.pt`` plus, from the shards, ``state_dict`` (every tensor whole, on the CPU) and
    ``optimizer_states`` (one per optimizer, keyed by parameter name as DCP saved them, not by index). Any other
    entry of the shards keeps its name.

    Args:
        path: the checkpoint directory (``step=K.ckpt/``).

    Raises:
        DamagedCheckpointError: for a directory without ``meta.pt`` or ``.metadata``, a damaged ``meta.pt``, or
            shards that cannot be read (missing, cut short, corrupted): the message names the directory and why.
        pickle.UnpicklingError: for a non-tensor entry of the shards of a type ``torch.load(weights_only=True)``
            refuses (as for a single-file checkpoint), naming the directory and the type.

    Examples:
        >>> import tempfile, warnings
        >>> import torch.distributed.checkpoint as dcp
        >>> _ = torch.manual_seed(0)
        >>> path = Path(tempfile.mkdtemp()) / "step=1.ckpt"
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        ...     _ = dcp.save({"state_dict": {"w": torch.rand(2)}}, checkpoint_id=path, no_dist=True)
        >>> torch.save({"global_step": 1}, path / "meta.pt")
        >>> checkpoint = load_distributed_checkpoint(path)
        >>> checkpoint["global_step"], checkpoint["state_dict"]["w"].shape, checkpoint["optimizer_states"]
        (1, torch.Size([2]), [])
    """
    path = Path(path)
    index = _checked_index(path)
    checkpoint = _load_meta(path / META)
    from torch.distributed.checkpoint import CheckpointException

    try:
        flat, mappings = _read_shards(path, index)
    except DamagedCheckpointError:
        raise
    except (Exception, CheckpointException) as err:  # DCP's own derives from BaseException
        raise _unreadable(path, err) from err
    shards = _nest(flat, mappings)
    weights = shards.pop("state_dict", None)
    checkpoint["state_dict"] = shards.pop("model", {}) if weights is None else weights
    optimizers = sorted((int(m.group(1)), key) for key in shards if (m := _OPTIMIZER.fullmatch(str(key))))
    checkpoint["optimizer_states"] = [shards.pop(key) for _, key in optimizers]
    checkpoint.update({key: value for key, value in shards.items() if not str(key).startswith(SHARD_MARK)})
    return checkpoint


__all__ = ["INDEX", "META", "check_distributed_checkpoint", "load_distributed_checkpoint"]
