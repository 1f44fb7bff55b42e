"""WorkerSeedCallback: a reproducible, distinct random stream for every (rank, loader, worker, epoch).

Lightning creates the epoch-0 iterator of the training loader inside ``FitLoop.setup_data()``, before
``on_train_start`` or ``on_train_epoch_start`` run, so a callback hook is too late to seed epoch 0. Every loader,
however, passes through ``strategy.process_dataloader()`` right after it is built and before its first ``iter()``.
The callback wraps that method on the strategy instance (any strategy, Lightning's own included) for the duration
of the run, and prepares each ``DataLoader`` there:

- ``worker_init_fn``: each worker seeds python, numpy and torch with
  ``derive_seed(base, global_rank, worker_id, iterator_seed)``, where ``iterator_seed`` is the seed PyTorch drew
  for that iterator (``torch.initial_seed() - worker_id`` in the worker); the user's own function runs after it.
- ``generator`` (unless the user gave one): a loader-private ``torch.Generator`` seeded from
  ``derive_seed(base, global_rank, "loader", stage, n)``. PyTorch draws each iterator's seed, and a
  ``RandomSampler`` its shuffle, from it instead of from the global RNG, so the data stream no longer depends on how
  many random numbers the model consumed.
- with ``per_sample=True``, every ``dataset[i]`` runs under RNG state seeded from
  ``derive_seed(base, "sample", epoch, i)``: the same sample, bitwise, whatever the number of workers, the batch size
  or the world size.
"""

from __future__ import annotations

import os
import random
import weakref
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, RandomSampler
from typing_extensions import override

from lightning_determinism.errors import DeterminismWarning
from lightning_determinism.resumable import next_train_epoch
from lightning_determinism.seeding import check_seed, derive_seed


def _seed_streams(seed: int, cpu_only: bool = False) -> None:
    random.seed(seed)
    np.random.seed(seed)
    if cpu_only:
        torch.default_generator.manual_seed(seed)  # ~50x cheaper than torch.manual_seed, which visits every backend
    else:
        torch.manual_seed(seed)


class _SeedWorker:
    """The ``worker_init_fn`` installed on each loader; picklable for spawned workers."""

    def __init__(self, base_seed: int, rank: int, user_fn: Callable[[int], None] | None) -> None:
        self.base_seed = base_seed
        self.rank = rank
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        iterator_seed = torch.initial_seed() - worker_id  # PyTorch seeds worker w with iterator_seed + w
        _seed_streams(derive_seed(self.base_seed, self.rank, worker_id, iterator_seed))
        if self.user_fn is not None:
            self.user_fn(worker_id)  # after ours, so the user can still override


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

    def __call__(self, indices: list[int]) -> list[Any]:
        epoch = int(self.epoch.item())
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


class WorkerSeedCallback(Callback):
    """Seed every data-loader worker reproducibly and distinctly per rank, loader, worker and epoch.

    Args:
        seed: base seed. ``None`` takes the deterministic strategy's base seed, else ``PL_GLOBAL_SEED`` (set by
            ``seed_everything``); without either, ``setup`` raises. Range-checked like
            :func:`~lightning_determinism.set_seed`.
        per_sample: also run each ``dataset[i]`` under RNG state derived from ``(base, epoch, i)`` so a sample's
            augmentation is independent of ``num_workers``, batch size and world size. Needs a map-style dataset
            and automatic batching (``batch_size`` not ``None``).

    Raises:
        TypeError: if ``seed`` is not an integer.
        ValueError: if ``seed`` is out of range.

    Example:
        >>> import lightning as L
        >>> trainer = L.Trainer(callbacks=[WorkerSeedCallback(seed=42)], logger=False, enable_progress_bar=False)
        >>> isinstance(trainer.callbacks[0], WorkerSeedCallback)
        True
    """

    def __init__(self, seed: int | None = None, per_sample: bool = False) -> None:
        self.seed = None if seed is None else check_seed(seed)
        if not isinstance(per_sample, bool):
            raise TypeError(f"`per_sample` must be a bool, got {per_sample!r}")
        self.per_sample = per_sample
        self.base_seed: int | None = None
        self._rank = 0
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()
        self._loaders_per_stage: dict[str, int] = {}
        self._own_generators: weakref.WeakKeyDictionary[DataLoader, torch.Generator] = weakref.WeakKeyDictionary()
        self._warned_types: set[str] = set()
        self._strategy: Any = None
        self._generators: dict[str, torch.Generator] = {}  # "stage/n" -> loader generator (and "stage/n/sampler")
        self._pending_states: dict[str, torch.Tensor] = {}
        self._resume_key: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Spawned ranks receive a pickled copy: weak references and the patched strategy stay behind.
        state = self.__dict__.copy()
        state["_own_generators"] = None
        state["_strategy"] = None
        state["_generators"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._own_generators = weakref.WeakKeyDictionary()

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._rank = trainer.global_rank
        self.base_seed = self._resolve_base_seed(trainer)
        self._epoch.fill_(trainer.current_epoch)
        self._loaders_per_stage = {}
        self._generators = {}
        strategy = trainer.strategy
        original = type(strategy).process_dataloader.__get__(strategy)

        def process_dataloader(dataloader: object) -> object:
            return self._prepare(original(dataloader), trainer)

        # An instance attribute shadowing the method; teardown removes it.
        strategy.process_dataloader = process_dataloader  # type: ignore[method-assign]
        self._strategy = strategy

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._strategy is not None:
            self._strategy.__dict__.pop("process_dataloader", None)
            self._strategy = None

    def loader_states(self) -> dict[str, torch.Tensor]:
        """The state of every loader generator this callback created, by ``"stage/n"`` (for checkpoints)."""
        return {key: gen.get_state() for key, gen in self._generators.items()}

    def load_loader_states(self, states: dict[str, torch.Tensor], resume_key: int | None = None) -> None:
        """Apply ``states`` to the loader generators as they are created; ``resume_key`` re-derives them instead."""
        self._pending_states = dict(states)
        self._resume_key = resume_key

    def _new_generator(self, key: str, *seed_keys: int | str) -> torch.Generator:
        assert self.base_seed is not None
        extra = () if self._resume_key is None else ("resume", self._resume_key)
        generator = torch.Generator()
        generator.manual_seed(derive_seed(self.base_seed, self._rank, *seed_keys, *extra))
        pending = self._pending_states.pop(key, None)
        if pending is not None:
            generator.set_state(pending)
        self._generators[key] = generator
        return generator

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Epochs after the first create their iterator after this hook (the first one's is set in `setup`).
        self._epoch.fill_(trainer.current_epoch)

    def _resolve_base_seed(self, trainer: pl.Trainer) -> int:
        if self.seed is not None:
            return check_seed(self.seed, trainer.world_size)
        strategy_seed = getattr(trainer.strategy, "base_seed", None)
        if strategy_seed is not None:
            return int(strategy_seed)
        env_seed = os.environ.get("PL_GLOBAL_SEED")
        if env_seed is not None:
            return check_seed(int(env_seed), trainer.world_size, name="PL_GLOBAL_SEED")
        raise RuntimeError(
            f"[rank: {trainer.global_rank}] WorkerSeedCallback has no seed: pass `WorkerSeedCallback(seed=...)`, call"
            " `lightning.seed_everything(...)` before `fit`, or use a deterministic strategy such as"
            " `strategy='ddp_deterministic'`."
        )

    def _prepare(self, dataloader: object, trainer: pl.Trainer) -> object:
        if not isinstance(dataloader, DataLoader):
            name = type(dataloader).__name__
            if name not in self._warned_types:
                self._warned_types.add(name)
                rank_zero_warn(
                    f"WorkerSeedCallback leaves a `{name}` alone: only `DataLoader` workers are seeded.",
                    category=DeterminismWarning,
                )
            return dataloader
        assert self.base_seed is not None
        stage = trainer.state.stage.value if trainer.state.stage is not None else "none"
        index = self._loaders_per_stage.get(stage, 0)
        self._loaders_per_stage[stage] = index + 1

        user_fn = dataloader.worker_init_fn
        if isinstance(user_fn, _SeedWorker):  # a loader we prepared in an earlier run
            user_fn = user_fn.user_fn
        dataloader.worker_init_fn = _SeedWorker(self.base_seed, self._rank, user_fn)

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
        if stage == "train":
            # The epoch about to run: a resumed run's, or the loop's (`current_epoch` lags by one until it starts).
            self._epoch.fill_(next_train_epoch(trainer))

        if self.per_sample:
            self._install_per_sample(dataloader)
        return dataloader

    def _install_per_sample(self, dataloader: DataLoader) -> None:
        dataset = dataloader.dataset
        if dataloader.batch_size is None and dataloader.batch_sampler is None or not hasattr(dataset, "__getitem__"):
            rank_zero_warn(
                "WorkerSeedCallback(per_sample=True) needs a map-style dataset and automatic batching; "
                f"`{type(dataset).__name__}` in a loader with batch_size=None is left without per-sample seeding.",
                category=DeterminismWarning,
            )
            return
        current = getattr(dataset, "__getitems__", None)
        if current is not None and not isinstance(current, _PerSampleGetItems):
            rank_zero_warn(
                f"WorkerSeedCallback(per_sample=True) replaces `{type(dataset).__name__}.__getitems__` by one"
                " `__getitem__` call per index under its own seed.",
                category=DeterminismWarning,
            )
        assert self.base_seed is not None
        dataset.__getitems__ = _PerSampleGetItems(dataset, self.base_seed, self._epoch)  # type: ignore[attr-defined]


__all__ = ["WorkerSeedCallback"]
