"""WorkerSeedCallback: a reproducible, distinct random stream for every (rank, loader, worker, epoch).

Lightning creates the epoch-0 iterator of the training loader inside ``FitLoop.setup_data()``, before
``on_train_start`` or ``on_train_epoch_start`` run, so a callback hook is too late to seed epoch 0. Every loader,
however, passes through ``strategy.process_dataloader()`` right after it is built and before its first ``iter()``.
The callback wraps that method on the strategy instance (any strategy, Lightning's own included) for the duration
of the run, and prepares each ``DataLoader`` there with
:class:`~lightning_determinism.data.worker_seeding.LoaderSeeding` (worker seeds, a loader-private generator,
per-sample seeds; the Fabric strategies share it).
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_determinism._compat.checks import require
from lightning_determinism._compat.features import WORKERS
from lightning_determinism.data.positions import next_train_epoch
from lightning_determinism.data.worker_seeding import LoaderSeeding
from lightning_determinism.seeding.seeds import check_seed


class WorkerSeedCallback(Callback):
    """Seed every data-loader worker reproducibly and distinctly per rank, loader, worker and epoch.

    Args:
        seed: base seed. ``None`` takes the deterministic strategy's base seed, else ``PL_GLOBAL_SEED`` (set by
            ``seed_everything``); without either, ``setup`` raises. Range-checked like
            :func:`~lightning_determinism.set_seed`.
        per_sample: also run each ``dataset[i]`` under RNG state derived from ``(base, epoch, i)`` so a sample's
            augmentation is independent of ``num_workers``, batch size and world size. Needs a map-style dataset
            and automatic batching (``batch_size`` not ``None``). World-size-invariant training refuses
            ``per_sample=False``: a worker's stream follows the rank that loads a sample.

    Raises:
        TypeError: if ``seed`` is not an integer.
        ValueError: if ``seed`` is out of range.

    Examples:
        >>> import lightning as L
        >>> trainer = L.Trainer(callbacks=[WorkerSeedCallback(seed=42)], logger=False, enable_progress_bar=False)
        >>> isinstance(trainer.callbacks[0], WorkerSeedCallback)
        True
    """

    def __init__(self, seed: int | None = None, per_sample: bool = False) -> None:
        require(WORKERS)
        self.seed = None if seed is None else check_seed(seed)
        if not isinstance(per_sample, bool):
            raise TypeError(f"`per_sample` must be a bool, got {per_sample!r}")
        self.per_sample = per_sample
        self.base_seed: int | None = None
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()
        self._seeding: LoaderSeeding | None = None
        self._strategy: Any = None
        self._pending: tuple[dict[str, torch.Tensor], int | None] = ({}, None)

    def __getstate__(self) -> dict[str, Any]:
        # Spawned ranks receive a pickled copy: the patched strategy and the loaders' generators stay behind.
        state = self.__dict__.copy()
        state["_strategy"] = None
        state["_seeding"] = None
        return state

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.base_seed = self._resolve_base_seed(trainer)
        self._epoch.fill_(trainer.current_epoch)
        if self._seeding is None:
            self._seeding = LoaderSeeding(self.base_seed, trainer.global_rank, self.per_sample)
        else:  # a later fit/validate/test of the same callback: its loaders are recognised as ours
            self._seeding.restart(self.base_seed, trainer.global_rank)
        self._seeding.load_loader_states(*self._pending)
        self._pending = ({}, None)
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

    def follow_base_seed(self, base_seed: int, rank: int) -> None:
        """Follow a base seed the strategy changed after :meth:`setup` (a resume taking its checkpoint's).

        Unless ``seed`` was given; before the loaders are prepared.
        """
        if self.seed is None and self._seeding is not None:
            self.base_seed = int(base_seed)
            self._seeding.restart(self.base_seed, rank)

    def loader_states(self) -> dict[str, torch.Tensor]:
        """The state of every loader generator this callback created, by ``"stage/n"`` (for checkpoints)."""
        return self._seeding.loader_states() if self._seeding is not None else {}

    def load_loader_states(self, states: dict[str, torch.Tensor], resume_key: int | None = None) -> None:
        """Apply ``states`` to the loader generators as they are created; ``resume_key`` re-derives them instead."""
        if self._seeding is not None:
            self._seeding.load_loader_states(states, resume_key)
        else:
            self._pending = (dict(states), resume_key)

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
        assert self._seeding is not None
        stage = trainer.state.stage.value if trainer.state.stage is not None else "none"
        if stage == "train":
            # The epoch about to run: a resumed run's, or the loop's (`current_epoch` lags by one until it starts).
            self._epoch.fill_(next_train_epoch(trainer))
        return self._seeding.prepare(dataloader, stage, self._epoch)


__all__ = ["WorkerSeedCallback"]
