"""Run-time accessors of the ``DataLoader`` internals the data side needs (and of Hugging Face's buffer and node).

Split from :mod:`lightning_determinism._compat.checks`, which checks every private name they read at import (its
:data:`~lightning_determinism._compat.checks.PIECES`); the accessors raise the same clear error if one is gone at run
time.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

from lightning_determinism._compat.access import _private
from lightning_determinism._compat.checks import _optional
from lightning_determinism._compat.checks import worker_module as _worker_module
from lightning_determinism._process import _rank_and_world_size

_BaseDataLoaderIter = _optional("torch.utils.data.dataloader:_BaseDataLoaderIter")
_MultiProcessingDataLoaderIter = _optional("torch.utils.data.dataloader:_MultiProcessingDataLoaderIter")
_remove_worker_pids = _optional("torch.utils.data._utils.signal_handling:_remove_worker_pids")


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
    planner (``restripe_items``) deals whole batches to ranks; with ``drop_last`` it also drops the rest's last
    ``world_size * num_workers * batch_size - 1`` samples at most. When the position is not such a multiple or samples
    would be dropped so, ``plans`` (``(remaining, world_size, num_workers, batch_size, drop_last) -> one plan per
    global worker``) deals the rest instead (with ``drop_last``, only a last round shorter than the world size is
    dropped); every other call goes to litdata's own. Not checked at import (litdata is optional).
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
        rest = len(stream) - max(0, int(drop_first))
        cut = drop_last and rest % (stride * max(1, int(num_workers))) != 0  # litdata would drop the odd samples
        if granularity != "item" or (int(drop_first) % stride == 0 and not cut):
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

    Raises:
        ValueError: The dataset's ``drop_last`` is not the one the state's epoch was planned with, other than by
            litdata's default following the world size (:func:`litdata_default_drop_last`).
    """
    inner = state.get("dataset")
    if not isinstance(inner, dict):
        return state
    rank, world = _rank_and_world_size()
    _check_drop_last(getattr(loader, "dataset", None), inner, rank, world)
    if "sample_in_epoch" not in inner:
        return state
    here = (world, int(loader.num_workers or 1), int(loader.batch_size or 1))
    if (inner.get("world_size"), inner.get("num_workers"), inner.get("batch_size")) == here:
        return state
    return {**state, "dataset": {**inner, "num_samples_yielded": 0}}


def _planned_world(state: dict[str, Any]) -> int:
    """The world size of the grid that planned a litdata state's epoch (a restriped epoch: the first grid's)."""
    return int(state.get("initial_world_size", state.get("world_size", 1)))


def _default_drop_last_change(state: dict[str, Any], drop_last: bool, world: int) -> bool:
    """Whether a state's ``drop_last`` and the dataset's differ only as litdata's default does across world sizes.

    ``StreamingDataset(drop_last=None)`` (the default) means ``True`` on 2 or more ranks and ``False`` on one.
    """
    planned = _planned_world(state)
    saved = bool(state.get("drop_last"))
    return planned != world and saved == (planned > 1) and bool(drop_last) == (world > 1) and saved != bool(drop_last)


def _check_drop_last(dataset: Any, state: dict[str, Any], rank: int, world: int) -> None:
    """Refuse, in one line and before any worker starts, a ``drop_last`` that litdata would refuse in every worker."""
    if "drop_last" not in state or not isinstance(getattr(dataset, "drop_last", None), bool):
        return
    saved, own = bool(state["drop_last"]), bool(dataset.drop_last)
    if saved == own or (_default_drop_last_change(state, own, world) and litdata_default_drop_last()):
        return
    raise ValueError(
        f"[rank: {rank}] `drop_last` of the StreamingDataset is {own}, but the checkpoint's epoch was planned with"
        f" {saved} on {_planned_world(state)} rank(s): create it with `drop_last={saved}` to resume that epoch"
    )


def litdata_default_drop_last() -> bool:
    """Let litdata resume an epoch on another world size under its default ``drop_last``; ``False`` if it cannot.

    ``StreamingDataset(drop_last=None)`` is ``True`` on 2 or more ranks and ``False`` on one, and litdata (0.2.76)
    refuses a state whose ``drop_last`` differs from the dataset's (``_validate_state_dict``, in every worker): a
    default resumed from 2 ranks on 1 or from 1 on 2 failed. Such a difference is accepted: the interrupted epoch
    stays the one its grid planned (the shuffler takes the state's ``drop_last``), the rest is dealt to the new grid
    with the dataset's own (on one rank nothing is dropped, on several ranks every rank gets as many batches), and
    the next epoch is the new grid's. Any other difference is refused as before. Not checked at import (litdata is
    optional).
    """
    try:
        import litdata.streaming.dataset as dataset
    except ImportError:
        return False
    cls = getattr(dataset, "StreamingDataset", None)
    original = getattr(cls, "_validate_state_dict", None)
    if getattr(original, "ldet_default_drop_last", False):
        return True
    if original is None:
        return False

    def validate(self: Any) -> None:
        state, env = getattr(self, "_state_dict", None), getattr(self, "distributed_env", None)
        if not state or env is None or not _default_drop_last_change(state, self.drop_last, int(env.world_size)):
            return original(self)  # type: ignore[no-any-return]
        planned = state["drop_last"]
        state["drop_last"] = self.drop_last  # for the check only: the epoch stays planned with the state's
        try:
            return original(self)  # type: ignore[no-any-return]
        finally:
            state["drop_last"] = planned

    validate.ldet_default_drop_last = True  # type: ignore[attr-defined]
    cls._validate_state_dict = validate  # type: ignore[union-attr]
    return True


def litdata_planned_drop_last(state: dict[str, Any], origin: dict[str, Any]) -> dict[str, Any]:
    """A litdata loader state taken during an epoch resumed from ``origin``, with the ``drop_last`` that planned it.

    litdata records the dataset's own ``drop_last`` in every state, and the first grid's world size
    (``initial_world_size``): after a resume under the default ``drop_last`` on another world size, the pair would
    describe a grid that never was, and a resume from it would plan the interrupted epoch differently.
    """
    inner, first = state.get("dataset"), origin.get("dataset")
    if not isinstance(inner, dict) or not isinstance(first, dict) or "drop_last" not in first:
        return state
    if inner.get("drop_last") == first["drop_last"]:
        return state
    return {**state, "dataset": {**inner, "drop_last": first["drop_last"]}}


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


class _InTurnExecutor:
    """``concurrent.futures``' executor interface that runs each task at once, in the calling thread."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as err:  # handed to whoever waits on the future, as a pool's worker thread does
            future.set_exception(err)
        return future

    def shutdown(self, wait: bool = True, **kwargs: Any) -> None:
        pass

    def __enter__(self) -> _InTurnExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class _FuturesInTurn:
    """``concurrent.futures`` as Hugging Face's ``iterable_dataset`` module sees it: pools run in turn where asked."""

    def __init__(self) -> None:
        self.real = concurrent.futures

    def ThreadPoolExecutor(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 (the name it stands in for)
        if getattr(_IN_TURN, "on", False):
            return _InTurnExecutor()
        return self.real.ThreadPoolExecutor(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


_IN_TURN = threading.local()


@contextlib.contextmanager
def hf_shards_in_turn(dataset: Any) -> Iterator[None]:
    """Within (this thread): a Hugging Face stream reads its shards in turn, not in its prefetch threads.

    ``datasets`` (5.2 here) interleaves a stream's shards (several files, ``to_iterable_dataset(num_shards=...)``,
    ``from_generator`` with lists in ``gen_kwargs``) by fetching each shard's next example in a thread pool: the
    user's functions of the pipeline (``map``, ``filter``, the generator) then draw from the process's one random
    stream in the order the threads happen to run, so the same seeds give other samples' contents (noise, masking,
    cropping) on every run and a resume cannot be bitwise. Read in turn, the draws come in the stream's own order;
    the examples and their order are the pool's. Nothing changes for other datasets, or where ``datasets`` has no
    such pool.
    """
    module = sys.modules.get("datasets.iterable_dataset")
    if module is None or not type(dataset).__module__.startswith("datasets."):
        yield
        return
    if isinstance(getattr(module, "concurrent", None), type(concurrent)):  # the package: stand in for its futures
        module.concurrent = types.SimpleNamespace(futures=_FuturesInTurn())  # type: ignore[attr-defined]
    before = getattr(_IN_TURN, "on", False)
    _IN_TURN.on = True
    try:
        yield
    finally:
        _IN_TURN.on = before


__all__ = [
    "base_index_sampler",
    "drop_loader_iterator",
    "forget_worker_pids",
    "hf_as_node",
    "hf_node",
    "hf_shards_in_turn",
    "hf_shuffles",
    "litdata_default_drop_last",
    "litdata_exact_restripe",
    "litdata_planned_drop_last",
    "litdata_state_for",
    "loader_iterator",
    "sampler_iter",
    "set_sampler_iter",
    "shutdown_workers",
    "torch_worker_numpy_seed",
    "worker_info_as",
    "worker_processes",
]
