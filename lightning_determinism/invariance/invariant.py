"""World-size-invariant training: the same bits on 1, 2, 4, ... processes.

The user fixes the global batch: ``B`` samples per optimizer step, in ``M = B / m`` micro-batches of ``m`` samples.
Everything that decides a step's numbers then depends on the micro-batch, never on the rank or the world size W:

- **data**: :class:`InvariantSampler` cuts one global order (a function of the base seed and the epoch) into
  micro-batches; rank ``r`` takes micro-batches ``r*K ... r*K + K - 1`` of every step, ``K = M / W`` (under FSDP2,
  micro-batches ``j*W + r``, ``j = 0 .. K-1``: each pass of the ranks covers adjacent leaves of the tree);
- **randomness**: before each micro-batch the CPU generator (and CUDA's) is reseeded from
  ``derive_seed(base, "micro-batch", step, j)``, ``j`` the micro-batch's index in the step;
- **gradients**: each micro-batch's gradient is a leaf of one fixed binary tree over ``j = 0 .. M-1``
  (:mod:`~lightning_determinism.invariance.tree`). A process sums its ``K`` leaves (a subtree); the subtrees are then
  added by chunks, each process adding its ``1/W`` of the gradient in the tree's order (a ring all-reduce's volume).
  DDP's own all-reduce does not run; under FSDP2 each pass's leaves are added inside its reduce-scatter
  (:mod:`~lightning_determinism.invariance.fsdp`). With ``M`` and ``W`` powers of two, the ``1/K`` loss scaling of
  Lightning's gradient accumulation and the final ``1/W`` are exact;
- **kernels**: intra-op threads are pinned per process (CPU reductions may split across threads differently).

:class:`InvariantTraining` ties these into a Lightning run; the strategies take it as their ``invariant`` argument
(``DeterministicDDPStrategy(global_batch_size=B, micro_batch_size=m)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_determinism._compat.access import wrapped_sampler
from lightning_determinism._compat.checks import BatchNorm, update_dataloader
from lightning_determinism.invariance.sampler import InvariantSampler
from lightning_determinism.invariance.tree import GradientTree
from lightning_determinism.seeding.seeds import StepSeeds, derive_seed


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def valid_world_sizes(micro_batches: int) -> list[int]:
    """World sizes a step of ``micro_batches`` micro-batches can be split over: powers of two dividing it.

    Examples:
        >>> valid_world_sizes(8)
        [1, 2, 4, 8]
    """
    return [w for w in range(1, micro_batches + 1) if _is_power_of_two(w) and micro_batches % w == 0]


def check_batch_sizes(global_batch_size: object, micro_batch_size: object) -> tuple[int, int]:
    """Validate ``B`` and ``m``: positive ints, ``m`` dividing ``B``, ``B / m`` a power of two.

    Raises:
        TypeError: for a value that is not an int.
        ValueError: naming the rule that is broken and the values.

    Examples:
        >>> check_batch_sizes(64, 8)
        (64, 8)
        >>> check_batch_sizes(48, 8)
        Traceback (most recent call last):
        ...
        ValueError: `global_batch_size / micro_batch_size` must be a power of two (1, 2, 4, 8, ...), got 48 / 8 = 6
    """
    for name, value in (("global_batch_size", global_batch_size), ("micro_batch_size", micro_batch_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"`{name}` must be a positive int, got {value!r}")
        if value < 1:
            raise ValueError(f"`{name}` must be a positive int, got {value}")
    assert isinstance(global_batch_size, int) and isinstance(micro_batch_size, int)
    if global_batch_size % micro_batch_size:
        raise ValueError(
            f"`micro_batch_size` must divide `global_batch_size`, got {global_batch_size} % {micro_batch_size}"
            f" = {global_batch_size % micro_batch_size}"
        )
    micro_batches = global_batch_size // micro_batch_size
    if not _is_power_of_two(micro_batches):
        raise ValueError(
            "`global_batch_size / micro_batch_size` must be a power of two (1, 2, 4, 8, ...), got"
            f" {global_batch_size} / {micro_batch_size} = {micro_batches}"
        )
    return global_batch_size, micro_batch_size


def micro_batch_seed(base: int, step: int, micro_batch: int) -> int:
    """The seed of one micro-batch's randomness: the same on any rank and world size.

    Examples:
        >>> micro_batch_seed(42, 0, 3) == micro_batch_seed(42, 0, 3) != micro_batch_seed(42, 1, 3)
        True
    """
    return derive_seed(base, "micro-batch", step, micro_batch)


def reseed_for_micro_batch(seed: int) -> None:
    """Seed the CPU generator (and CUDA's, where initialised) for one micro-batch: ~1 µs, manual_seed ~120 µs."""
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():  # False without CUDA too, and ~30x cheaper than is_available()
        torch.cuda.manual_seed(seed)


def find_batch_norm(module: torch.nn.Module) -> str | None:
    """The name of the first batch-norm layer (whose running statistics depend on the rank's micro-batches)."""
    for name, child in module.named_modules():
        if isinstance(child, BatchNorm):
            return name or type(child).__name__
    return None


def describe(global_batch_size: int, micro_batch_size: int, world_size: int, threads: int) -> str:
    """The one line the strategies print at setup."""
    micro_batches = global_batch_size // micro_batch_size
    per_rank = micro_batches // world_size
    return (
        f"world-size-invariant training: B={global_batch_size} samples per optimizer step in {micro_batches}"
        f" micro-batches of m={micro_batch_size}; {world_size} process(es) x {per_rank} micro-batches"
        f" (accumulate_grad_batches={per_rank}); gradients summed over a fixed binary tree, not by DDP;"
        f" {threads} intra-op thread(s) per process; valid world sizes: {valid_world_sizes(micro_batches)}"
    )


def keep_local_gradients(state: object, bucket: Any) -> torch.futures.Future[Tensor]:
    """A DDP communication hook that communicates nothing: each process keeps its own gradient."""
    future: torch.futures.Future[Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


# DDP checks a hook's annotations as objects; this module's annotations are strings (postponed evaluation).
keep_local_gradients.__annotations__ = {
    "state": object,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


class InvariantTraining:
    """The invariant mode of one strategy: configuration, checks, data, per-micro-batch seeds and the gradient tree.

    Args:
        global_batch_size: ``B``, samples per optimizer step (over all processes).
        micro_batch_size: ``m``, samples per forward/backward pass; the training ``DataLoader``'s ``batch_size``.
        threads: intra-op threads per process (pinned: CPU kernels may reduce differently on more threads).

    Raises:
        TypeError, ValueError: see :func:`check_batch_sizes`; ``threads`` must be a positive int.
    """

    def __init__(self, global_batch_size: int, micro_batch_size: int, threads: int = 1) -> None:
        self.global_batch_size, self.micro_batch_size = check_batch_sizes(global_batch_size, micro_batch_size)
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"`invariant_threads` must be a positive int, got {threads!r}")
        self.threads = threads
        self.micro_batches = global_batch_size // micro_batch_size
        self.world_size = 1
        self.rank = 0
        self.base_seed = 0
        self._tree: GradientTree | None = None
        self._passes_in_window = 0
        self._seeds = StepSeeds(self.base_seed, "micro-batch")  # micro_batch_seed, the step's hash state kept
        self._in_fsdp = False  # FSDP2's reduce-scatter sums over the tree (invariance.fsdp), not the GradientTree
        self._positive_zeros = False  # under ModelParallelStrategy: the tree's sums end with + 0.0, as FSDP2's do
        self._strided = False  # under FSDP2 on several processes: rank r runs micro-batches j*W + r

    @property
    def per_rank(self) -> int:
        """``K``: micro-batches of one step on one process."""
        return self.micro_batches // self.world_size

    def state(self) -> dict[str, int]:
        """What a checkpoint records to resume on another world size."""
        return {"global_batch_size": self.global_batch_size, "micro_batch_size": self.micro_batch_size,
                "micro_batches_per_rank": self.per_rank}  # fmt: skip

    def check_world_size(self, world_size: int) -> None:
        """Refuse a world size that does not split the step's micro-batches evenly into a power-of-two tree."""
        if world_size not in valid_world_sizes(self.micro_batches):
            raise ValueError(
                f"world-size-invariant training with B={self.global_batch_size} and m={self.micro_batch_size}"
                f" ({self.micro_batches} micro-batches per step) runs on {valid_world_sizes(self.micro_batches)}"
                f" processes, got {world_size}"
            )

    def check_accumulation(self, accumulate_grad_batches: int, world_size: int) -> None:
        """Refuse an ``accumulate_grad_batches`` other than 1 (unset) or ``K = B / (m * W)``."""
        per_rank = self.micro_batches // world_size
        if accumulate_grad_batches not in (1, per_rank):
            raise ValueError(
                f"`accumulate_grad_batches={accumulate_grad_batches}` contradicts world-size-invariant training, which"
                f" accumulates B / (m * W) = {self.global_batch_size} / ({self.micro_batch_size} * {world_size})"
                f" = {per_rank} micro-batches per process: leave it out of the Trainer"
            )

    def check_before_launch(self, world_size: int, accumulate_grad_batches: int, module: torch.nn.Module) -> None:
        """Every check that the main process can make before it starts the ranks: a refusal is then said once."""
        self.check_world_size(world_size)
        self.check_accumulation(accumulate_grad_batches, world_size)
        self.check_module(module)

    def setup_environment(self, rank: int, world_size: int, base_seed: int) -> None:
        """Ranks are known: check the world size, pin the threads."""
        self.check_world_size(world_size)
        self.rank, self.world_size, self.base_seed = rank, world_size, base_seed
        self._seeds = StepSeeds(base_seed, "micro-batch")
        torch.set_num_threads(self.threads)

    def set_base_seed(self, base_seed: int) -> None:
        """A base seed settled after :meth:`setup_environment` (Fabric: a ``seed_everything`` after ``launch()``)."""
        self.base_seed = base_seed
        self._seeds = StepSeeds(base_seed, "micro-batch")

    def begun(self) -> int:
        """How many of this process's micro-batches of the current step have begun (0 .. ``K``)."""
        return self._passes_in_window

    def last_micro_batch(self) -> bool:
        """Whether the micro-batch running now is the step's last on this process."""
        return self._passes_in_window == self.per_rank

    def reduce_in_fsdp(self, module: torch.nn.Module) -> int:
        """Sum the gradients of ``module``'s ``FSDPModule``s over the tree inside FSDP2's reduce-scatter.

        On one process FSDP2 reduces nothing: the :class:`GradientTree` sums the (whole) sharded gradients there.
        On several, rank ``r`` runs micro-batches ``j*W + r`` from now on (the training loader is not built yet).

        Returns:
            The number of ``FSDPModule``s.
        """
        from lightning_determinism.invariance.fsdp import fsdp_modules, install_tree_reduce_scatter

        self._positive_zeros = True  # one process sums in the GradientTree: its zeros as FSDP2's are, positive
        if self.world_size == 1:
            return len(fsdp_modules(module))
        count = install_tree_reduce_scatter(module, self.last_micro_batch, self.per_rank, self.world_size)
        self._in_fsdp = self._strided = count > 0
        return count

    def setup(self, trainer: Any) -> None:
        """Before the optimizers exist: set (or check) gradient accumulation to ``K``."""
        self.check_accumulation(trainer.accumulate_grad_batches, self.world_size)
        trainer.accumulate_grad_batches = self.per_rank
        if self._tree is not None:
            self._tree.disarm()
        self._tree = None
        self._passes_in_window = 0
        self._in_fsdp = False
        self._positive_zeros = False
        self._strided = False

    def check_module(self, module: torch.nn.Module) -> None:
        """Refuse layers whose state depends on the rank's micro-batches, and manual optimization."""
        if not getattr(module, "automatic_optimization", True):
            raise ValueError(
                "world-size-invariant training drives the accumulation of micro-batches itself: it needs"
                " `automatic_optimization=True`, got a module with manual optimization"
            )
        name = find_batch_norm(module)
        if name is not None:
            raise ValueError(
                f"world-size-invariant training cannot keep batch-norm running statistics invariant: `{name}`"
                " averages over the micro-batches of its own process. Use LayerNorm/GroupNorm, or train without the"
                " invariant mode"
            )

    def before_micro_batch(self, global_step: int) -> None:
        """Reseed the generators for the micro-batch about to run.

        Before the step's last micro-batch, its backward is set to overlap with the communication
        (:meth:`~lightning_determinism.invariance.tree.GradientTree.arm`).
        """
        passes = self._passes_in_window
        index = passes * self.world_size + self.rank if self._strided else self.rank * self.per_rank + passes
        reseed_for_micro_batch(self._seeds(global_step, index))
        self._passes_in_window += 1
        if self._passes_in_window == self.per_rank and self._tree is not None:
            self._tree.arm()

    def process_train_loader(self, dataloader: Any, rank: int, world_size: int) -> Any:
        """The training loader with :class:`InvariantSampler` in place of its sampler.

        Raises:
            ValueError: for a loader that is not a map-style ``DataLoader`` with ``batch_size == m``, or a dataset
                length that ``B`` does not divide.
        """
        from torch.utils.data import DataLoader, IterableDataset, RandomSampler

        if not isinstance(dataloader, DataLoader) or isinstance(dataloader.dataset, IterableDataset):
            kind = type(getattr(dataloader, "dataset", dataloader)).__name__
            raise ValueError(
                "world-size-invariant training needs a map-style dataset in a torch DataLoader (samples are addressed"
                f" by index to cut one global order into micro-batches), got a `{kind}`"
            )
        if dataloader.batch_size != self.micro_batch_size:
            raise ValueError(
                f"the training DataLoader's `batch_size` must be the micro-batch size m={self.micro_batch_size},"
                f" got {dataloader.batch_size}"
            )
        sampler = dataloader.sampler
        inner = wrapped_sampler(sampler)  # Lightning's DistributedSamplerWrapper
        shuffle = bool(getattr(sampler, "shuffle", False)) or isinstance(sampler, RandomSampler)
        shuffle = shuffle or isinstance(inner, RandomSampler)
        new = InvariantSampler(
            len(dataloader.dataset),  # type: ignore[arg-type]
            self.global_batch_size,
            self.micro_batch_size,
            world_size,
            rank,
            self.base_seed,
            shuffle,
            strided=self._strided,
        )
        return update_dataloader(dataloader, new)

    def after_backward(self, parameters: Sequence[torch.nn.Parameter], global_step: int | None = None) -> None:
        """Take this micro-batch's gradient as a leaf; after the last one, climb the tree and set the mean gradient.

        ``global_step`` (the step being finished): the next step's seeds are hashed while this step's first level of
        communication is still in flight.
        """
        if self._in_fsdp:  # summed in FSDP2's reduce-scatter: the window ends with its last micro-batch
            if self.last_micro_batch():
                if global_step is not None:
                    self._seeds.prepare(global_step + 1)
                self._passes_in_window = 0
            return
        if self._tree is None:
            self._tree = GradientTree(parameters, self.per_rank, self.world_size)
            self._tree.positive_zeros = self._positive_zeros
        self._tree.add_leaf()
        if self._tree.added < self.per_rank:
            return
        if global_step is not None:
            self._seeds.prepare(global_step + 1)
        self._passes_in_window = 0
        # Each leaf was scaled by 1/K (Lightning's accumulation); 1/W more makes the mean over all M micro-batches.
        self._tree.finish(divide_by=self.world_size)


__all__ = [
    "InvariantSampler",
    "InvariantTraining",
    "check_batch_sizes",
    "describe",
    "find_batch_norm",
    "micro_batch_seed",
    "keep_local_gradients",
    "reseed_for_micro_batch",
    "valid_world_sizes",
]
