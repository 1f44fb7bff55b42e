"""Run-time accessors of the ``DataLoader`` internals the data side needs (and of Hugging Face's buffer and node).

Split from :mod:`lightning_determinism._compat`, which checks every private name they read at import (its
:data:`~lightning_determinism._compat.PIECES`); the accessors raise the same clear error if one is gone at run time.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

from lightning_determinism._compat import (
    _BaseDataLoaderIter,
    _MultiProcessingDataLoaderIter,
    _private,
    _remove_worker_pids,
)
from lightning_determinism._compat import worker_module as _worker_module
from lightning_determinism.seeding import _rank_and_world_size


def loader_iterator(loader: Any) -> Any:
    """A ``DataLoader``'s persistent-workers iterator (``None`` until one exists)."""
    return _private(loader, "_iterator")


def drop_loader_iterator(loader: Any) -> None:
    """Forget a ``DataLoader``'s persistent-workers iterator: the next ``iter()`` starts new workers."""
    _private(loader, "_iterator")
    loader._iterator = None


def base_index_sampler(cls: type, loader: Any) -> Any:
    """The index sampler of ``loader`` as the ``DataLoader`` class ``cls`` defines it (its ``_index_sampler``)."""
    return _private(cls, "_index_sampler").fget(loader)


def worker_processes(iterator: Any) -> list[Any]:
    """The worker processes of a multi-process ``DataLoader`` iterator; ``[]`` for any other iterator."""
    return list(_private(iterator, "_workers")) if isinstance(iterator, _MultiProcessingDataLoaderIter) else []


def forget_worker_pids(iterator: Any) -> None:
    """Take the iterator's workers out of torch's SIGCHLD watch, so killing them is not reported as a crash."""
    if _private(iterator, "_worker_pids_set"):
        _remove_worker_pids(id(iterator))
        iterator._worker_pids_set = False


def shutdown_workers(iterator: Any) -> None:
    """Stop a multi-process ``DataLoader`` iterator's workers."""
    _private(iterator, "_shutdown_workers")()


def sampler_iter(iterator: Any) -> Iterator[Any] | None:
    """The index iterator of a single-process ``DataLoader`` iterator; ``None`` otherwise (workers drew already)."""
    if not isinstance(iterator, _BaseDataLoaderIter) or int(_private(iterator, "_num_workers")):
        return None
    return _private(iterator, "_sampler_iter")  # type: ignore[no-any-return]


def set_sampler_iter(iterator: Any, indices: Iterator[Any]) -> None:
    """Replace the index iterator of a single-process ``DataLoader`` iterator."""
    _private(iterator, "_sampler_iter")
    iterator._sampler_iter = indices


def torch_worker_numpy_seed(base_seed: int, worker_id: int) -> Any:
    """The numpy seed PyTorch's worker loop gives worker ``worker_id`` of an iterator with ``base_seed``."""
    return _private(_worker_module, "_generate_state")(base_seed, worker_id)


@contextlib.contextmanager
def worker_info_as(worker: int, num_workers: int, seed: int, dataset: Any) -> Iterator[None]:
    """Within: ``get_worker_info()`` describes worker ``worker`` of ``num_workers`` (``None`` for 0 workers)."""
    before = _private(_worker_module, "_worker_info")
    info = _worker_module.WorkerInfo(id=worker, num_workers=num_workers, seed=seed, dataset=dataset)
    _worker_module._worker_info = info if num_workers > 0 else None
    try:
        yield
    finally:
        _worker_module._worker_info = before


def litdata_exact_restripe(plans: Any) -> bool:
    """Make litdata restripe a resumed epoch at the exact sample; ``False`` where its planner is not the known one.

    litdata (0.2.76) rounds the position of an epoch resumed on another grid down to a whole global batch of the new
    grid (``_round_down_drop_first``), so up to ``world_size * batch_size - 1`` samples are trained twice, because its
    planner (``restripe_items``) deals whole batches to ranks. When the position is not such a multiple, ``plans``
    (``(remaining, world_size, num_workers, batch_size, drop_last) -> one plan per global worker``) deals the rest
    instead; every other call goes to litdata's own. Not checked at import (litdata is optional).
    """
    try:
        import litdata.streaming.dataloader as dataloader
        import litdata.streaming.dataset as dataset
    except ImportError:
        return False
    original = getattr(dataset, "restripe_items", None)
    if getattr(original, "ldet_exact", False):
        return True
    rounding = [module for module in (dataset, dataloader) if hasattr(module, "_round_down_drop_first")]
    if original is None or len(rounding) != 2:
        return False

    def restripe(stream: Any, *, world_size: int, num_workers: int, batch_size: int, drop_first: int = 0,
                 drop_last: bool = False, granularity: str = "item") -> Any:  # fmt: skip
        stride = max(1, int(world_size)) * max(1, int(batch_size))
        if granularity != "item" or int(drop_first) % stride == 0:
            return original(stream, world_size=world_size, num_workers=num_workers, batch_size=batch_size,
                            drop_first=drop_first, drop_last=drop_last, granularity=granularity)  # fmt: skip
        return plans(list(stream[int(drop_first) :]), int(world_size), max(1, int(num_workers)), int(batch_size),
                     bool(drop_last))  # fmt: skip

    def keep_position(drop_first: int, world_size: int, batch_size: int) -> int:
        return max(0, int(drop_first))  # restripe() rounds where litdata's own planner deals the rest

    restripe.ldet_exact = True  # type: ignore[attr-defined]
    dataset.restripe_items = restripe
    for module in rounding:  # the workers' plans and the main process's count of the epoch's consumed samples
        module._round_down_drop_first = keep_position
    return True


def litdata_state_for(loader: Any, state: dict[str, Any]) -> dict[str, Any]:
    """A litdata loader state to load on this loader's grid.

    On another grid litdata continues from the epoch's global count (``sample_in_epoch``) but still checks the old
    grid's per-rank count against the new grid's shorter per-rank length, refusing a resume past it (2 ranks -> 4
    after 5 of 8 batches: "num_samples_yielded ... greater than the dataset length"); that count is not used then.
    """
    inner = state.get("dataset")
    if not isinstance(inner, dict) or "sample_in_epoch" not in inner:
        return state
    here = (_rank_and_world_size()[1], int(loader.num_workers or 1), int(loader.batch_size or 1))
    if (inner.get("world_size"), inner.get("num_workers"), inner.get("batch_size")) == here:
        return state
    return {**state, "dataset": {**inner, "num_samples_yielded": 0}}


def hf_node(dataset: Any) -> Any:
    """The node a Hugging Face ``IterableDataset`` reads as (``split_dataset_by_node``), ``None`` if not split."""
    return getattr(dataset, "_distributed", None)


def hf_as_node(dataset: Any, rank: int, world_size: int) -> None:
    """Make a Hugging Face ``IterableDataset`` read node ``rank`` of ``world_size`` (in place; a split one only)."""
    node = hf_node(dataset)
    if node is not None:
        dataset._distributed = dataclasses.replace(node, rank=rank, world_size=world_size)


def hf_shuffles(dataset: Any) -> bool:
    """Whether a Hugging Face ``IterableDataset`` has a shuffle buffer, whose content its state drops (#7901).

    Found in its chain of examples iterables; ``True`` when unsure (replay, always exact). Not checked at import.
    """
    node = getattr(dataset, "_ex_iterable", None)
    while node is not None and not hasattr(node, "ex_iterables"):  # several sources: unsure
        if type(node).__name__ == "BufferShuffledExamplesIterable":
            return True
        node = getattr(node, "ex_iterable", None)
    return node is not None or not hasattr(dataset, "_ex_iterable")


__all__ = [
    "base_index_sampler",
    "drop_loader_iterator",
    "forget_worker_pids",
    "hf_as_node",
    "hf_node",
    "hf_shuffles",
    "litdata_exact_restripe",
    "litdata_state_for",
    "loader_iterator",
    "sampler_iter",
    "set_sampler_iter",
    "shutdown_workers",
    "torch_worker_numpy_seed",
    "worker_info_as",
    "worker_processes",
]
