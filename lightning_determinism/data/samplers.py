"""Evaluation samplers that count every sample exactly once.

Lightning injects a ``DistributedSampler`` into validation and test loaders; with ``drop_last=False`` it pads the
dataset with repeated samples until its size divides by the world size, so a metric over 7 samples on 2 ranks sees
8. Evaluation does not need equal batch counts per rank (no gradient sync), so the deterministic strategies swap
that sampler for :class:`UnpaddedDistributedSampler`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torchmetrics
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSamplerWrapper
from torch.utils.data import DataLoader, DistributedSampler

from lightning_determinism._compat.access import module_trainer, trainer_results, wrapped_sampler
from lightning_determinism._compat.checks import update_dataloader
from lightning_determinism.seeding.isolation import current_evaluation_pass
from lightning_determinism.seeding.seeds import derive_seed


class UnpaddedDistributedSampler(DistributedSampler):
    """A ``DistributedSampler`` that gives rank ``r`` the indices ``r, r + world, r + 2 * world, ...`` and no padding.

    Shuffling, when asked for, uses the same ``seed + epoch`` permutation as ``DistributedSampler``; inside an
    evaluation pass of the deterministic strategies
    (:func:`~lightning_determinism.seeding.isolation.evaluation_streams`) the permutation comes from ``(seed, stage,
    epoch, step)`` instead, so that two passes in one epoch read two orders, as a shuffled loader on one device does.
    Ranks may get one sample more or less than each other: fine for evaluation, not for training under DDP.

    Examples:
        >>> [list(UnpaddedDistributedSampler(range(7), num_replicas=2, rank=r, shuffle=False)) for r in (0, 1)]
        [[0, 2, 4, 6], [1, 3, 5]]
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["drop_last"] = False
        super().__init__(*args, **kwargs)
        total = len(self.dataset)  # type: ignore[arg-type]
        self.total_size = total
        self.num_samples = max(0, math.ceil((total - self.rank) / self.num_replicas))

    def __iter__(self) -> Iterator[int]:
        total = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            generator = torch.Generator()
            evaluation = current_evaluation_pass()
            if evaluation is None:
                generator.manual_seed(self.seed + self.epoch)
            else:  # a new order for every evaluation pass, agreed by all ranks (Lightning #17843)
                generator.manual_seed(derive_seed(self.seed, "evaluation-order", *evaluation))
            indices = torch.randperm(total, generator=generator).tolist()
        else:
            indices = list(range(total))
        return iter(indices[self.rank : total : self.num_replicas])


# Lightning warns, before any strategy sees the loader, that evaluating on several devices repeats samples. The
# deterministic strategies then swap in UnpaddedDistributedSampler, which makes that warning false.
_PADDING_WARNING = r"Using `DistributedSampler` with the dataloaders\. During `trainer\.(validate|test)\(\)`"


class PaddingWarningFilter:
    """While installed, hide Lightning's "replicates some samples" warning (and only it); ``remove()`` undoes it.

    Examples:
        >>> import warnings
        >>> quiet = PaddingWarningFilter()
        >>> with warnings.catch_warnings(record=True) as seen:
        ...     warnings.simplefilter("always")
        ...     quiet.install()
        ...     warnings.warn("Using `DistributedSampler` with the dataloaders. During `trainer.validate()`, ...")
        ...     quiet.remove()
        >>> seen
        []
    """

    def __init__(self) -> None:
        self._entry: tuple[Any, ...] | None = None

    def install(self) -> None:
        """Put the filter first among ``warnings.filters`` (once, however often it is called)."""
        if self._entry is None:
            warnings.filterwarnings("ignore", message=_PADDING_WARNING)
            self._entry = warnings.filters[0]

    def remove(self) -> None:
        """Take this filter out again, leaving every other one as it is."""
        if self._entry is not None and self._entry in warnings.filters:
            # An "ignore" leaves nothing in the callers' warning registries: taking the entry out is all it takes.
            warnings.filters.remove(self._entry)  # type: ignore[attr-defined]  # a list at run time
        self._entry = None


def unpad_eval_dataloader(dataloader: object) -> object:
    """Swap a padding ``DistributedSampler`` in an evaluation loader for one that counts each sample once.

    Anything else (non-``DataLoader`` iterables, other samplers, a single replica) is returned unchanged.

    Examples:
        >>> loader = DataLoader(range(7), sampler=DistributedSampler(range(7), num_replicas=2, rank=1, shuffle=False))
        >>> len(loader.sampler), len(unpad_eval_dataloader(loader).sampler)
        (4, 3)
    """
    if not isinstance(dataloader, DataLoader):
        return dataloader
    sampler = dataloader.sampler
    kind = type(sampler)
    if kind not in (DistributedSampler, DistributedSamplerWrapper) or sampler.num_replicas == 1:  # type: ignore[attr-defined]
        return dataloader
    kwargs = {"num_replicas": sampler.num_replicas, "rank": sampler.rank, "shuffle": sampler.shuffle}  # type: ignore[attr-defined]
    if kind is DistributedSampler:
        new: DistributedSampler = UnpaddedDistributedSampler(sampler.dataset, seed=sampler.seed, **kwargs)  # type: ignore[attr-defined]
    else:
        new = UnrepeatedDistributedSamplerWrapper(wrapped_sampler(sampler), **kwargs)
    return update_dataloader(dataloader, new)


def eval_batch_counts(dataloader: object) -> list[int] | None:
    """How many batches every rank runs through an unpadded evaluation loader (``None`` if it cannot be told).

    Every rank computes the same list, from the dataset length, the world size and the batch size.

    Examples:
        >>> loader = DataLoader(range(9), batch_size=4, sampler=UnpaddedDistributedSampler(range(9), 2, 0, False))
        >>> eval_batch_counts(loader)
        [2, 1]
    """
    if not isinstance(dataloader, DataLoader) or not isinstance(dataloader.sampler, UnpaddedDistributedSampler):
        return None
    sampler, batch_size = dataloader.sampler, dataloader.batch_size
    if batch_size is None:
        return None  # a user's batch sampler: its batch count is its own
    total, world = sampler.total_size, sampler.num_replicas
    counts = []
    for rank in range(world):
        samples = max(0, math.ceil((total - rank) / world))
        counts.append(samples // batch_size if dataloader.drop_last else math.ceil(samples / batch_size))
    return counts


class UnevenEvalGuard:
    """Refuses a per-step collective while ranks run different numbers of evaluation batches.

    With every sample evaluated once, ranks may run one batch more or less. A collective issued on every step
    (``self.log(..., on_step=True, sync_dist=True)`` or a metric with ``dist_sync_on_step=True``) would then wait
    forever on the ranks that have a batch more. Every rank knows the counts of all ranks, so all of them raise at the
    first such collective, together, instead of hanging.
    """

    def __init__(self) -> None:
        self._hooked: set[int] = set()

    def watch(self, dataloader: object, module: Any) -> None:
        """Hook the module's step-synced metrics if this evaluation loader gives ranks uneven batch counts."""
        counts = eval_batch_counts(dataloader)
        if counts is None or len(set(counts)) == 1:
            return
        for metric in module.modules():
            if isinstance(metric, torchmetrics.Metric) and metric.dist_sync_on_step and id(metric) not in self._hooked:
                self._hooked.add(id(metric))
                metric.register_forward_pre_hook(_StepSyncHook(self, module))

    def check(self, what: str, trainer: Any) -> None:
        """Raise if ``what`` is a per-step collective while the current evaluation loaders are uneven.

        Raises:
            RuntimeError: naming the collective, the batch counts and what to do instead.
        """
        if trainer is None or not (trainer.evaluating or trainer.sanity_checking):
            return
        results = trainer_results(trainer)
        if results is None or results.batch is None:
            return  # epoch-end collectives run on every rank alike
        loaders = trainer.test_dataloaders if trainer.testing else trainer.val_dataloaders
        if isinstance(loaders, dict):
            loaders = list(loaders.values())
        for loader in loaders if isinstance(loaders, (list, tuple)) else [loaders]:
            counts = eval_batch_counts(loader)
            if counts is None or len(set(counts)) == 1:
                continue
            listed = ", ".join(f"rank {r}: {n}" for r, n in enumerate(counts))
            raise RuntimeError(
                f"[rank: {trainer.global_rank}] {what} syncs across ranks on every evaluation step, but the ranks"
                f" run different numbers of batches here ({listed}), because every sample is evaluated exactly once:"
                " the ranks with fewer batches would never join the last collective and the run would hang. Log"
                " evaluation values per epoch (on_step=False, the default in validation), use"
                " dist_sync_on_step=False, or pass Trainer(use_distributed_sampler=False) with a sampler of your own."
            )


class _StepSyncHook:
    """A metric's forward pre-hook: the metric syncs on every step, so ask the guard first (picklable)."""

    def __init__(self, guard: UnevenEvalGuard, module: Any) -> None:
        self.guard = guard
        self.module = module

    def __call__(self, metric: Any, args: Any) -> None:
        self.guard.check(f"{type(metric).__name__}(dist_sync_on_step=True)", trainer_of(self.module))


def trainer_of(module: Any) -> Any:
    """The trainer a LightningModule is attached to, or ``None``."""
    return module_trainer(module)


__all__ = [
    "PaddingWarningFilter",
    "UnevenEvalGuard",
    "UnpaddedDistributedSampler",
    "eval_batch_counts",
    "unpad_eval_dataloader",
]
