"""Run-time accessors of the ``DataLoader`` internals the data side needs (and of Hugging Face's shuffle buffer).

Split from :mod:`lightning_determinism._compat`, which checks every private name they read at import (its
:data:`~lightning_determinism._compat.PIECES`); the accessors raise the same clear error if one is gone at run time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from lightning_determinism._compat import (
    _BaseDataLoaderIter,
    _MultiProcessingDataLoaderIter,
    _private,
    _remove_worker_pids,
)
from lightning_determinism._compat import worker_module as _worker_module


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
    "hf_shuffles",
    "loader_iterator",
    "sampler_iter",
    "set_sampler_iter",
    "shutdown_workers",
    "worker_info_as",
    "worker_processes",
]
