"""The seeding contract under Lightning Fabric: deterministic strategies, worker seeding, RNG state in ``fabric.save``.

Fabric's ``seed_everything(s)`` seeds every rank with ``s``, and ``fabric.save`` holds no RNG state. With these
strategies (registered in Fabric's own registry under the Trainer's names: ``Fabric(strategy="ddp_deterministic")``)
the Trainer's contract holds in a hand-written loop, at these points of Fabric's life cycle:

1. ``fabric.launch()`` (the strategy's ``setup_environment``, once ranks and the process group exist): agree on the
   base seed, export it, set the backend flags, seed every rank with the *base* seed — models built next (before
   ``fabric.setup`` or inside ``fabric.init_module()``) are identical on every rank and to a one-process run.
   A ``fabric.seed_everything(s)`` called after ``launch()`` (Fabric's usual order) becomes the base seed;
2. the first ``fabric.setup(model, ...)`` (``setup_module``): seed every rank with ``base + rank`` (or the
   topology's streams) for training-time draws;
3. ``fabric.setup_dataloaders(...)`` (``process_dataloader``): the loader's workers, shuffle and (``per_sample``)
   samples are seeded as the Trainer's :class:`~lightning_determinism.WorkerSeedCallback` seeds them
   (:class:`~lightning_determinism.data.worker_seeding.LoaderSeeding`); loaders are numbered in the order they are set
   up, the first keyed like the Trainer's first training loader. A loader's epoch is the number of times it has
   been iterated, as Fabric counts it for ``DistributedSampler.set_epoch``.

:class:`FabricRNGState` goes into the state of ``fabric.save``/``fabric.load``: every rank's RNG state and its
loaders' generators and epoch counts, verified on restore like :class:`~lightning_determinism.RNGStateCheckpoint`.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.strategies import (
    STRATEGY_REGISTRY,
    DDPStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
)
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, IterableDataset, RandomSampler
from typing_extensions import override

from lightning_determinism._compat.access import (
    device_mesh_of,
    fabric_inner_loader,
    fabric_iterations,
    set_fabric_iterations,
)
from lightning_determinism.checkpoints.io import AtomicCheckpointIOMixin
from lightning_determinism.data.positions import PLAN_ATTR
from lightning_determinism.data.resumable import make_fork_safe, make_resumable
from lightning_determinism.data.stateful import is_stateful_loader, make_stateful
from lightning_determinism.data.worker_seeding import LoaderSeeding
from lightning_determinism.errors import DeterminismWarning
from lightning_determinism.invariance.tree import PairwiseAllReduce
from lightning_determinism.parallel.mesh import follow_mesh
from lightning_determinism.parallel.topology import Topology
from lightning_determinism.seeding.backends import determinism_report
from lightning_determinism.seeding.rank_states import (
    all_gather,
    check_ranks,
    digest,
    other_seed_message,
    verify_restored,
)
from lightning_determinism.seeding.rng import capture_rng_state, restore_rng_state
from lightning_determinism.seeding.seeds import _rank_and_world_size, current_seeds, derive_seed, seed_all
from lightning_determinism.strategies.arguments import check_keywords
from lightning_determinism.strategies.launchers import destroy_gloo_group_at_exit
from lightning_determinism.strategies.seeding_steps import SeedingProperties, SeedingSteps


class DeterministicFabricStrategyMixin(AtomicCheckpointIOMixin, SeedingProperties):
    """Adds the seeding contract to a Fabric strategy: ``class MyStrategy(DeterministicFabricStrategyMixin, ...)``.

    ``fabric.save`` writes atomically where the file lives
    (:class:`~lightning_determinism.checkpoints.io.AtomicCheckpointIO`) unless the strategy is given a ``CheckpointIO``
    of the user's own.

    Args:
        seed: base seed; ``None`` takes ``PL_GLOBAL_SEED`` (``seed_everything``) or has rank 0 draw one.
        debug_mode: backend flags, as in :func:`~lightning_determinism.configure_determinism`.
        topology: model-parallel degrees (a dict) or a :class:`~lightning_determinism.parallel.topology.Topology`.
        seed_workers: seed the workers, shuffle and generator of every loader passed to ``fabric.setup_dataloaders``.
        per_sample: also run each ``dataset[i]`` under RNG state derived from ``(base, epoch, i)``.
        args: passed on to the strategy.
        kwargs: passed on to the strategy.

    Examples:
        >>> DeterministicFabricDDPStrategy(seed=3, start_method="popen").seed
        3
    """

    def __init__(
        self,
        *args: Any,
        seed: int | None = None,
        debug_mode: Any = "error",
        topology: Topology | dict[str, Any] | None = None,
        seed_workers: bool = True,
        per_sample: bool = False,
        **kwargs: Any,
    ) -> None:
        check_keywords(type(self), DeterministicFabricStrategyMixin, kwargs)
        self._ldet_steps = SeedingSteps(seed, debug_mode, topology)
        for name, value in (("seed_workers", seed_workers), ("per_sample", per_sample)):
            if not isinstance(value, bool):
                raise TypeError(f"`{name}` must be a bool, got {value!r}")
        self.seed_workers, self.per_sample = seed_workers, per_sample
        self._ldet_seeding: LoaderSeeding | None = None
        self._ldet_model_ready = False
        super().__init__(*args, **kwargs)

    @override
    def setup_environment(self) -> None:  # type: ignore[misc]
        super().setup_environment()  # type: ignore[misc]
        destroy_gloo_group_at_exit()
        mesh = device_mesh_of(self)
        if mesh is not None:  # Fabric's ModelParallelStrategy: the mesh's rule (see mesh_seeding)
            follow_mesh(self._ldet_steps, mesh, self.global_rank, self.world_size)  # type: ignore[attr-defined]
        # Announced at the first fabric.setup(model): a seed_everything() after launch() may still change it.
        self._ldet_steps.ranks_known(self.global_rank, self.world_size, announce=False)  # type: ignore[attr-defined]

    def _ldet_model_built(self) -> None:
        """The first ``fabric.setup(model)``: a late ``seed_everything`` becomes the base; then ``base + rank``."""
        if self._ldet_model_ready:
            return
        self._ldet_model_ready = True
        rank: int = self.global_rank  # type: ignore[attr-defined]
        self._ldet_steps.adopt_later_seed(rank, self.world_size)  # type: ignore[attr-defined]
        self._ldet_steps.model_built(rank)
        self._ldet_steps.announce(rank)

    @override
    def setup_module_and_optimizers(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
        result = super().setup_module_and_optimizers(*args, **kwargs)  # type: ignore[misc]
        self._ldet_model_built()
        return result

    @override
    def setup_module(self, module: torch.nn.Module) -> Any:  # type: ignore[misc]
        result = super().setup_module(module)  # type: ignore[misc]
        self._ldet_model_built()
        return result

    @override
    def process_dataloader(self, dataloader: DataLoader) -> DataLoader:  # type: ignore[misc]
        dataloader = super().process_dataloader(dataloader)  # type: ignore[misc]
        if is_stateful_loader(dataloader):  # litdata: its own position, saved by FabricRNGState at the last batch
            return make_stateful(dataloader, None)
        stream = isinstance(dataloader, DataLoader) and isinstance(dataloader.dataset, IterableDataset)
        if not self.seed_workers and not stream or not isinstance(dataloader, DataLoader):
            return dataloader
        base = self._ldet_steps.base_seed
        if base is None:
            raise RuntimeError("`fabric.setup_dataloaders` ran before `fabric.launch()`: the base seed is unknown")
        if self._ldet_seeding is None:
            owner = f"{type(self).__name__}(per_sample=True)" if self.per_sample else type(self).__name__
            self._ldet_seeding = LoaderSeeding(base, self.global_rank, self.per_sample, owner=owner)  # type: ignore[attr-defined]
        epoch = torch.zeros((), dtype=torch.int64).share_memory_()
        if self.seed_workers:
            self._ldet_seeding.prepare(dataloader, "train", epoch)
        # A stream resumes mid-epoch (FabricRNGState keeps its position); map-style loaders between epochs.
        dataloader = make_resumable(dataloader, None) if stream else make_fork_safe(dataloader)  # type: ignore[assignment]
        dataloader._ldet_epoch = epoch  # type: ignore[attr-defined]  # set at each iter() (see resumable)
        dataloader._ldet_iterations = 0  # type: ignore[attr-defined]
        return dataloader

    @override
    def teardown(self) -> None:  # type: ignore[misc]
        super().teardown()  # type: ignore[misc]
        self._ldet_steps.restore_env()


class DeterministicFabricDDPStrategy(DeterministicFabricStrategyMixin, DDPStrategy):
    """Fabric's ``DDPStrategy`` with the seeding contract.

    Registered in Fabric as ``ddp_deterministic`` (popen), ``ddp_spawn_deterministic``, ``ddp_fork_deterministic``
    and ``ddp_notebook_deterministic``. On more than two processes the gradient buckets are reduced over a fixed tree
    of two-process all-reduces (:class:`~lightning_determinism.invariance.tree.PairwiseAllReduce`): the sums do not
    depend on DDP's bucket layout, which a module set up again (a resumed loop) rebuilds.
    """

    @override
    def setup_module(self, module: torch.nn.Module) -> DistributedDataParallel:
        ddp = super().setup_module(module)
        if self.world_size > 2:
            ddp.register_comm_hook(None, PairwiseAllReduce(self.world_size, self.global_rank).reduce)  # type: ignore[arg-type]
        return ddp


class DeterministicFabricFSDPStrategy(DeterministicFabricStrategyMixin, FSDPStrategy):
    """Fabric's ``FSDPStrategy`` with the seeding contract; registered as ``fsdp_deterministic`` (CUDA only)."""


class DeterministicFabricModelParallelStrategy(DeterministicFabricStrategyMixin, ModelParallelStrategy):
    """Fabric's ``ModelParallelStrategy`` (FSDP2 + tensor parallel) seeded by its device mesh, as the Trainer's.

    Not registered by name: Fabric's strategy takes the user's ``parallelize_fn(module, device_mesh)`` first, as
    ``DeterministicFabricModelParallelStrategy(parallelize_fn, data_parallel_size=..., tensor_parallel_size=...,
    seed=...)``. The rule: :class:`~lightning_determinism.DeterministicModelParallelStrategy`.

    ``fabric.load`` of a distributed checkpoint restores stateful objects (``FabricRNGState``) as Fabric's other
    strategies do: Fabric's ``ModelParallelStrategy`` put the saved dict in their place in ``state`` instead, so the
    RNG streams were silently not restored and a resumed loop drew other numbers.
    """

    @override
    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]  # weights_only: Lightning >= 2.6 only
        stateful = {}
        if isinstance(state, dict):
            stateful = {key: obj for key, obj in state.items()
                        if not isinstance(obj, (torch.nn.Module, torch.optim.Optimizer))
                        and callable(getattr(obj, "load_state_dict", None))}  # fmt: skip
        remainder: dict[str, Any] = super().load_checkpoint(path, state, strict, **kwargs)
        for key, obj in stateful.items():
            saved = state[key]
            if saved is not obj:  # Fabric replaced the object by what was saved for it
                obj.load_state_dict(saved)
                state[key] = obj
        return remainder


class DeterministicFabricSingleDeviceStrategy(DeterministicFabricStrategyMixin, SingleDeviceStrategy):
    """Fabric's ``SingleDeviceStrategy`` with the seeding contract; ``single_device_deterministic`` (the CPU)."""


_REGISTRATIONS: tuple[tuple[str, type, dict[str, Any]], ...] = (
    ("ddp_deterministic", DeterministicFabricDDPStrategy, {"start_method": "popen"}),
    ("ddp_spawn_deterministic", DeterministicFabricDDPStrategy, {"start_method": "spawn"}),
    ("ddp_fork_deterministic", DeterministicFabricDDPStrategy, {"start_method": "fork"}),
    ("ddp_notebook_deterministic", DeterministicFabricDDPStrategy, {"start_method": "fork"}),
    ("fsdp_deterministic", DeterministicFabricFSDPStrategy, {}),
    ("single_device_deterministic", DeterministicFabricSingleDeviceStrategy, {"device": "cpu"}),
)


def register_fabric_strategies() -> list[str]:
    """Register the deterministic strategies in Fabric's ``STRATEGY_REGISTRY``; safe to call again.

    Examples:
        >>> "ddp_deterministic" in register_fabric_strategies()
        True
    """
    for name, cls, init_params in _REGISTRATIONS:
        description = f"{cls.__name__} {init_params or ''}".strip()
        STRATEGY_REGISTRY.register(name, cls, description=description, override=True, **init_params)
    return [name for name, _, _ in _REGISTRATIONS]


FABRIC_STATE_KEY = "FabricRNGState"
_FORMAT = 1


def _inner(loader: Any) -> Any:
    """The ``DataLoader`` inside Fabric's wrapper (or the loader itself)."""
    return fabric_inner_loader(loader)


def _generators(loader: Any) -> dict[str, torch.Generator]:
    inner = _inner(loader)
    found = {}
    if getattr(inner, "generator", None) is not None:
        found["generator"] = inner.generator
    sampler = getattr(inner, "sampler", None)
    if isinstance(sampler, RandomSampler) and sampler.generator is not None:
        found["sampler_generator"] = sampler.generator
    return found


def _position(loader: Any) -> dict[str, Any] | None:
    """Where a stream or a stateful loader stands inside its epoch (``None``: between epochs, or map-style)."""
    inner = _inner(loader)
    if is_stateful_loader(inner) and hasattr(inner, "_ldet_position_at"):
        return inner._ldet_position_at(inner._ldet_batches, finished=inner._ldet_epoch_done)  # type: ignore[no-any-return]
    position = getattr(inner, "_ldet_position", None)
    if position is None or getattr(inner, "_ldet_epoch_done", True):
        return None
    return {"epoch": _iterations(loader) - 1, "stream": position.at(position.batches)}


def _resume_at(loader: Any, position: dict[str, Any] | None) -> None:
    """The loader's next iteration continues at ``position`` (see :func:`_position`)."""
    if position is None:
        return
    inner = _inner(loader)
    if "stream" in position:  # the next iter() serves the interrupted epoch again
        set_fabric_iterations(loader, int(position["epoch"]))
        inner._ldet_iterations = int(position["epoch"])
    setattr(inner, PLAN_ATTR, position)


def _iterations(loader: Any) -> int:
    """How many times the loader was iterated (its epoch, as Fabric counts it)."""
    return int(getattr(_inner(loader), "_ldet_iterations", fabric_iterations(loader)))


class FabricRNGState:
    """Every rank's RNG state and its loaders' positions, for ``fabric.save`` / ``fabric.load``.

    Put it in the state dict next to the model and optimizer; Fabric calls :meth:`state_dict` on every rank when
    saving (it gathers all ranks' states to the saving rank) and :meth:`load_state_dict` on every rank when loading.

    Args:
        loaders: the loaders returned by ``fabric.setup_dataloaders`` whose generators and epoch counts to keep.

    Restores, per rank, the python, numpy, torch (CPU and CUDA) and tracker streams, each loader's generators and
    the number of times it was iterated (Fabric's ``DistributedSampler`` epoch and the per-sample seeds follow it),
    then verifies that every rank holds its own saved state. Map-style loaders: save between epochs (their position
    inside an epoch is not kept). Streams (an ``IterableDataset``, litdata's ``StreamingDataLoader``) keep their
    position: saved mid-epoch, the next ``iter(loader)`` after loading continues the interrupted epoch at the exact
    sample (docs/streaming.md). A checkpoint from another world size: a warning, every rank reseeds from
    ``derive_seed(base, "resume", iterations, rank)`` and loader generators are re-derived — reproducible, not the
    uninterrupted run; never one rank's state copied to all.

    Examples:
        >>> state = FabricRNGState()
        >>> sorted(state.state_dict())
        ['base_seed', 'format', 'ranks', 'report', 'world_size']
    """

    def __init__(self, *loaders: Any) -> None:
        self.loaders = loaders

    def state_dict(self) -> dict[str, Any]:
        """This rank's state, gathered from every rank (collective: call it on every rank)."""
        rng = capture_rng_state()
        loaders = [
            {
                "iterations": _iterations(loader),
                "position": _position(loader),
                **{key: gen.get_state() for key, gen in _generators(loader).items()},
            }
            for loader in self.loaders
        ]
        local = {"rng": rng, "digest": digest(rng), "loaders": loaders}
        ranks = all_gather(local)
        base = current_seeds()["base_seed"]
        return {
            "format": _FORMAT,
            "world_size": len(ranks),
            "base_seed": -1 if base is None else int(base),
            "ranks": ranks,
            "report": determinism_report(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's state (collective: call it on every rank)."""
        ranks = check_ranks(state, FABRIC_STATE_KEY)
        rank, world_size = _rank_and_world_size()
        if len(self.loaders) != len(ranks[0].get("loaders", [])):
            raise ValueError(
                f"`{FABRIC_STATE_KEY}` was saved with {len(ranks[0].get('loaders', []))} loader(s) and is loaded"
                f" into one with {len(self.loaders)}: pass the same loaders, in the same order"
            )
        same_world = state["world_size"] == world_size
        entry = ranks[rank] if same_world else ranks[0]
        iterations = [int(saved["iterations"]) for saved in entry["loaders"]]
        for loader, count in zip(self.loaders, iterations, strict=True):
            set_fabric_iterations(loader, count)  # Fabric sets the DistributedSampler's epoch from it
            if hasattr(_inner(loader), "_ldet_iterations"):
                _inner(loader)._ldet_iterations = count
        base = int(state.get("base_seed", -1))
        base = base if base >= 0 else int(current_seeds()["base_seed"] or 0)
        if not same_world:
            rank_zero_warn(
                f"The Fabric checkpoint was written by {state['world_size']} ranks and is loaded on {world_size}: each"
                f" rank reseeds from derive_seed(base={base}, 'resume', {sum(iterations)}, rank); the run stays"
                " reproducible but is not bitwise the uninterrupted one.",
                category=DeterminismWarning,
            )
            seed_all(derive_seed(base, "resume", sum(iterations), rank))
            for index, loader in enumerate(self.loaders):
                for key, gen in _generators(loader).items():
                    gen.manual_seed(derive_seed(base, rank, "resume", sum(iterations), index, key))
            return
        for loader, saved in zip(self.loaders, entry["loaders"], strict=True):
            _resume_at(loader, saved.get("position"))
        message = other_seed_message(state.get("base_seed", -1), current_seeds()["base_seed"])
        if message is not None:
            rank_zero_warn(message, category=DeterminismWarning)
        restore_rng_state(entry["rng"])
        for loader, saved in zip(self.loaders, entry["loaders"], strict=True):
            for key, gen in _generators(loader).items():
                if key in saved:
                    gen.set_state(saved[key])
        verify_restored(state, rank, digest(capture_rng_state()))


__all__ = [
    "DeterministicFabricDDPStrategy",
    "DeterministicFabricFSDPStrategy",
    "DeterministicFabricModelParallelStrategy",
    "DeterministicFabricSingleDeviceStrategy",
    "DeterministicFabricStrategyMixin",
    "FabricRNGState",
    "register_fabric_strategies",
]
