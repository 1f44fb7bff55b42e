"""Seeding a ``DataLoader``'s workers, shuffle and samples: the Lightning-free core of worker seeding.

:class:`LoaderSeeding` prepares loaders for one process (a base seed and a rank). It is shared by
:class:`~lightning_determinism.WorkerSeedCallback` (the Trainer) and the Fabric strategies
(:mod:`lightning_determinism.strategies.fabric`), so both give a loader the same streams for the same seed, rank,
loader, worker and epoch:

- ``worker_init_fn``: each worker seeds python, numpy and torch with
  ``derive_seed(base, rank, worker_id, iterator_seed)``, where ``iterator_seed`` is the seed PyTorch drew
  for that iterator (``torch.initial_seed() - worker_id`` in the worker); the user's own function runs after it.
- ``generator`` (unless the user gave one): a loader-private ``torch.Generator`` seeded from
  ``derive_seed(base, rank, "loader", stage, n)``. PyTorch draws each iterator's seed from it instead of from the
  global RNG, so the data stream no longer depends on how many random numbers the model consumed.
- a ``RandomSampler`` (unless the user gave it a generator): a generator of its own, from
  ``derive_seed(base, rank, "sampler", stage, n)``, and no draw past its last index (:class:`_ExactRandomSampler`),
  so each epoch's shuffle depends on the epochs before, not on how far ahead the loader's iterator read.
- with ``per_sample=True``, every ``dataset[i]`` runs under RNG state seeded from
  ``derive_seed(base, "sample", epoch, i)``: the same sample, bitwise, whatever the number of workers, the batch
  size or the world size; and a ``collate_fn`` of the user's runs under RNG state seeded from the epoch and the
  batch's indices (:class:`_PerBatchCollate`): the same batch, masks drawn there included.
"""

from __future__ import annotations

import functools
import hashlib
import random
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader, IterableDataset, RandomSampler

from lightning_determinism.data.stream_state import may_draw, seeded_streams
from lightning_determinism.errors import DeterminismWarning
from lightning_determinism.seeding.seeds import derive_seed


def _seed_streams(seed: int, cpu_only: bool = False) -> None:
    random.seed(seed)
    np.random.seed(seed)
    if cpu_only:
        torch.default_generator.manual_seed(seed)  # ~100x cheaper than torch.manual_seed, which visits every backend
    else:
        torch.manual_seed(seed)


class _SeedWorker:
    """The ``worker_init_fn`` installed on each loader; picklable for spawned workers."""

    def __init__(self, base_seed: int, rank: int, user_fn: Callable[[int], None] | None) -> None:
        self.base_seed = base_seed
        self.rank = rank
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        self.start_as(worker_id, torch.initial_seed() - worker_id)  # PyTorch seeds worker w with iterator_seed + w

    def start_as(self, worker_id: int, iterator_seed: int) -> None:
        """Seed this worker as worker ``worker_id`` of the iterator whose seed is ``iterator_seed``, then the user's."""
        _seed_streams(derive_seed(self.base_seed, self.rank, worker_id, iterator_seed))
        if self.user_fn is not None:
            self.user_fn(worker_id)  # after ours, so the user can still override


class _ExactRandomSampler(RandomSampler):
    """PyTorch's ``RandomSampler`` without the draw it makes when asked for an index past its last one.

    ``RandomSampler.__iter__`` (without replacement) draws one permutation per ``n`` indices, then one more for the
    ``num_samples % n`` left: an empty slice of a full permutation when none are left, drawn only if its iterator is
    asked for one index more than there are. A multi-process loader's prefetch asks; an in-process one, which
    Lightning stops after ``len(loader)`` batches, does not when the batch size divides the dataset: the next
    epoch's shuffle then depended on ``num_workers``. Here: the same draws in the same order, minus that one.
    """

    def __iter__(self) -> Iterator[int]:
        n = len(self.data_source)
        # With replacement the last draw is an empty `randint`, which draws nothing.
        if self.replacement or self.generator is None or not n or self.num_samples % n:
            return super().__iter__()
        return self._whole_permutations(n, self.num_samples // n)

    def _whole_permutations(self, n: int, count: int) -> Iterator[int]:
        for _ in range(count):  # `yield from` a list: a resumed epoch's skip (`_index_skip.consume`) stays O(1)
            yield from torch.randperm(n, generator=self.generator).tolist()


class _PerSampleGetItems:
    """Installed as ``dataset.__getitems__``: each item is produced under RNG seeded from (base, epoch, index).

    PyTorch's map-style fetcher calls ``dataset.__getitems__(indices)`` when the attribute exists, in the main
    process (``num_workers=0``) and in every worker alike; the epoch lives in shared memory so that persistent
    workers see it change.
    """

    ldet_per_sample = True  # how the resumable loaders recognise per-sample seeding

    def __init__(self, dataset: Any, base_seed: int, epoch: torch.Tensor) -> None:
        self.dataset = dataset
        self.base_seed = base_seed
        self.epoch = epoch
        self.last: tuple[int, list[int]] | None = None  # (epoch, indices) of the batch just read: its collate's key

    def __call__(self, indices: list[int]) -> list[Any]:
        epoch = int(self.epoch.item())
        self.last = epoch, indices
        getitem = type(self.dataset).__getitem__
        py_state, np_state, torch_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
        try:
            items = []
            for index in indices:
                _seed_streams(derive_seed(self.base_seed, "sample", epoch, int(index)), cpu_only=True)
                items.append(getitem(self.dataset, index))
            return items
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)
            torch.set_rng_state(torch_state)


class _PerBatchCollate:
    """Installed as a per-sample loader's ``collate_fn``: each batch is collated under RNG seeded from its samples.

    PyTorch's fetcher calls it right after ``dataset.__getitems__`` (:class:`_PerSampleGetItems`, read when called:
    a loader prepared later over the same dataset installs another), in the same process, which leaves the batch's
    epoch and indices behind: python, numpy and torch's CPU stream are seeded from
    ``derive_seed(base, "collate", epoch, h)`` (``h`` a 64-bit digest of the indices) and put back after. Randomness
    drawn there (masking, as ``DataCollatorForLanguageModeling`` does) then depends on the epoch and the batch's
    samples only, like each sample's: not on the worker, nor on the batches the worker collated before.
    """

    def __init__(self, inner: Callable[[Any], Any], dataset: Any) -> None:
        self.inner, self.dataset = inner, dataset

    def __call__(self, items: Any) -> Any:
        getitems = getattr(self.dataset, "__getitems__", None)
        if not isinstance(getitems, _PerSampleGetItems) or getitems.last is None:
            return self.inner(items)  # not a batch the per-sample fetch read (called by hand): as it is
        (epoch, indices), getitems.last = getitems.last, None
        digest = hashlib.blake2b(np.asarray(indices, dtype=np.int64).tobytes(), digest_size=8).digest()
        seed = derive_seed(getitems.base_seed, "collate", epoch, int.from_bytes(digest, "little"))
        with seeded_streams(seed):
            return self.inner(items)


def _lightning_worker_init(fn: Any) -> bool:
    """Whether ``fn`` is Lightning's own ``pl_worker_init_function`` (added by ``seed_everything(workers=True)``)."""
    inner = fn.func if isinstance(fn, functools.partial) else fn
    return getattr(inner, "__name__", "") == "pl_worker_init_function"


class LoaderSeeding:
    """Prepares the ``DataLoader`` objects of one process: worker seeds, a private generator, per-sample seeds.

    Args:
        base_seed: the run's base seed.
        rank: this process's global rank.
        per_sample: run each ``dataset[i]`` under RNG state derived from ``(base, epoch, i)``.
        owner: how warnings name the object that asked for the seeding.

    Examples:
        >>> seeding = LoaderSeeding(base_seed=1, rank=0, per_sample=False)
        >>> loader = seeding.prepare(DataLoader(range(4), batch_size=2, shuffle=True), "train")
        >>> loader.generator is not None
        True
    """

    def __init__(self, base_seed: int, rank: int, per_sample: bool, owner: str = "WorkerSeedCallback") -> None:
        self.base_seed, self.rank, self.per_sample, self.owner = base_seed, rank, per_sample, owner
        self.epoch = torch.zeros((), dtype=torch.int64).share_memory_()  # the per-sample seeds' epoch, by default
        self.generators: dict[str, torch.Generator] = {}  # "stage/n" -> loader generator (and "stage/n/sampler")
        self._loaders_per_stage: dict[str, int] = {}
        self._own_generators: weakref.WeakKeyDictionary[DataLoader, torch.Generator] = weakref.WeakKeyDictionary()
        self._warned_types: set[str] = set()
        self._pending_states: dict[str, torch.Tensor] = {}
        self._resume_key: int | None = None

    def restart(self, base_seed: int, rank: int) -> None:
        """Start numbering loaders again (a new run); loaders prepared earlier still count as prepared here."""
        self.base_seed, self.rank = base_seed, rank
        self.generators = {}
        self._loaders_per_stage = {}

    def loader_states(self) -> dict[str, torch.Tensor]:
        """The state of every loader generator created here, by ``"stage/n"`` (for checkpoints)."""
        return {key: gen.get_state() for key, gen in self.generators.items()}

    def load_loader_states(self, states: dict[str, torch.Tensor], resume_key: int | None = None) -> None:
        """Apply ``states`` to the loader generators as they are created; ``resume_key`` re-derives them instead."""
        self._pending_states = dict(states)
        self._resume_key = resume_key

    def _new_generator(self, key: str, *seed_keys: int | str) -> torch.Generator:
        extra = () if self._resume_key is None else ("resume", self._resume_key)
        generator = torch.Generator()
        generator.manual_seed(derive_seed(self.base_seed, self.rank, *seed_keys, *extra))
        pending = self._pending_states.pop(key, None)
        if pending is not None:
            generator.set_state(pending)
        self.generators[key] = generator
        return generator

    def prepare(self, dataloader: object, stage: str, epoch: torch.Tensor | None = None) -> object:
        """Seed ``dataloader`` (in place) as the next loader of ``stage``; anything else is returned with a warning.

        ``epoch`` is the shared int64 tensor the per-sample seeds read (default: :attr:`epoch`).
        """
        if not isinstance(dataloader, DataLoader):
            name = type(dataloader).__name__
            if name not in self._warned_types:
                self._warned_types.add(name)
                rank_zero_warn(
                    f"{self.owner} leaves a `{name}` alone: only `DataLoader` workers are seeded.",
                    category=DeterminismWarning,
                )
            return dataloader
        index = self._loaders_per_stage.get(stage, 0)
        self._loaders_per_stage[stage] = index + 1

        user_fn = dataloader.worker_init_fn
        if isinstance(user_fn, _SeedWorker):  # a loader we prepared in an earlier run
            user_fn = user_fn.user_fn
        if _lightning_worker_init(user_fn):  # Fabric adds it under seed_everything(workers=True): ours replaces it
            user_fn = None
        dataloader.worker_init_fn = _SeedWorker(self.base_seed, self.rank, user_fn)

        if dataloader.generator is None or self._own_generators.get(dataloader) is dataloader.generator:
            generator = self._new_generator(f"{stage}/{index}", "loader", stage, index)
            dataloader.generator = generator
            self._own_generators[dataloader] = generator
            sampler = dataloader.sampler
            if isinstance(sampler, RandomSampler) and (
                sampler.generator is None or getattr(sampler, "_ldet_generator", False)
            ):
                sampler.generator = self._new_generator(f"{stage}/{index}/sampler", "sampler", stage, index)
                sampler._ldet_generator = True  # type: ignore[attr-defined]
                if type(sampler) is RandomSampler:  # a user's subclass may iterate its own way: left as it is
                    sampler.__class__ = _ExactRandomSampler
        if self.per_sample:
            self._install_per_sample(dataloader, self.epoch if epoch is None else epoch)
        return dataloader

    def _install_per_sample(self, dataloader: DataLoader, epoch: torch.Tensor) -> None:
        dataset = dataloader.dataset
        if isinstance(dataset, IterableDataset):
            rank_zero_warn(
                f"{self.owner}(per_sample=True) has no meaning for `{type(dataset).__name__}`, a stream: its samples"
                " have no index to seed from. They draw from their (rank, worker, epoch) stream instead, which the"
                " deterministic strategies reseed every epoch and replay on resume (docs/streaming.md).",
                category=DeterminismWarning,
            )
            return
        if dataloader.batch_size is None and dataloader.batch_sampler is None or not hasattr(dataset, "__getitem__"):
            rank_zero_warn(
                f"{self.owner}(per_sample=True) needs a map-style dataset and automatic batching; "
                f"`{type(dataset).__name__}` in a loader with batch_size=None is left without per-sample seeding.",
                category=DeterminismWarning,
            )
            return
        current = getattr(dataset, "__getitems__", None)
        if current is not None and not isinstance(current, _PerSampleGetItems):
            rank_zero_warn(
                f"{self.owner}(per_sample=True) replaces `{type(dataset).__name__}.__getitems__` by one"
                " `__getitem__` call per index under its own seed.",
                category=DeterminismWarning,
            )
        dataset.__getitems__ = _PerSampleGetItems(dataset, self.base_seed, epoch)  # type: ignore[attr-defined]
        collate = dataloader.collate_fn
        if isinstance(collate, _PerBatchCollate):  # a loader prepared in an earlier run
            collate = collate.inner
        if may_draw(collate):
            dataloader.collate_fn = _PerBatchCollate(collate, dataset)


__all__ = ["LoaderSeeding"]
