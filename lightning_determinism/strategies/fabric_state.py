"""``FabricRNGState``: every rank's RNG state and its loaders' positions in ``fabric.save`` / ``fabric.load``.

The state half of the Fabric seeding contract (:mod:`~lightning_determinism.strategies.fabric` holds the strategies):
what a hand-written loop saves next to its model and optimizer so that a resumed loop draws what the uninterrupted
one drew.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch.utils.data import RandomSampler

from lightning_determinism._compat.access import fabric_inner_loader, fabric_iterations, set_fabric_iterations
from lightning_determinism.callbacks.run_identity import fabric_identity
from lightning_determinism.data.fabric_epoch import fabric_position
from lightning_determinism.data.positions import PLAN_ATTR
from lightning_determinism.data.stateful import is_stateful_loader
from lightning_determinism.errors import DeterminismWarning
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

if TYPE_CHECKING:
    from lightning_determinism.strategies.fabric_invariant import FabricInvariantLoop

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
    """Where a loader stands inside its epoch (``None``: between epochs)."""
    inner = _inner(loader)
    if is_stateful_loader(inner) and hasattr(inner, "_ldet_position_at"):
        return inner._ldet_position_at(inner._ldet_batches, finished=inner._ldet_epoch_done)  # type: ignore[no-any-return]
    position = getattr(inner, "_ldet_position", None)
    if position is None:  # map-style: the batches the loop drew in this epoch, and the epoch's RNG states
        return fabric_position(inner, _iterations(loader) - 1)
    if getattr(inner, "_ldet_epoch_done", True):
        return None
    return {"epoch": _iterations(loader) - 1, "stream": position.at(position.batches)}


def _resume_at(loader: Any, position: dict[str, Any] | None) -> None:
    """The loader's next iteration continues at ``position`` (see :func:`_position`)."""
    if position is None:
        return
    inner = _inner(loader)
    if "stream" in position or "skip" in position:  # the next iter() serves the interrupted epoch again
        set_fabric_iterations(loader, int(position["epoch"]))
        inner._ldet_iterations = int(position["epoch"])
    setattr(inner, PLAN_ATTR, position)


def _iterations(loader: Any) -> int:
    """How many times the loader was iterated (its epoch, as Fabric counts it)."""
    return int(getattr(_inner(loader), "_ldet_iterations", fabric_iterations(loader)))


def warn_unsaved_positions(state: Any, loaders: list[Any]) -> None:
    """At ``fabric.save``: say which of ``loaders`` stands inside an epoch no ``FabricRNGState`` in ``state`` keeps.

    A loop resumed from such a checkpoint starts that loader over instead of continuing its epoch.
    """
    held = {id(_inner(loader)) for obj in (state.values() if isinstance(state, dict) else ())
            if isinstance(obj, FabricRNGState) for loader in obj.loaders}  # fmt: skip
    for loader in loaders:
        if id(loader) in held or _position(loader) is None:
            continue
        name = type(getattr(loader, "dataset", loader)).__name__
        rank_zero_warn(
            f"`fabric.save` {int(getattr(loader, '_ldet_drawn', 0)) or 'some'} batches into epoch"
            f" {_iterations(loader) - 1} of the loader over `{name}`, whose position no `{FABRIC_STATE_KEY}` in the"
            " saved state holds: a loop resumed from this checkpoint starts that loader over instead of continuing"
            f" the epoch, and trains other batches than this run. Put `{FABRIC_STATE_KEY}(loader)` in the saved state"
            " (its next iteration after `fabric.load` serves the rest of the epoch, bitwise), or save between epochs.",
            category=DeterminismWarning,
        )


class FabricRNGState:
    """Every rank's RNG state and its loaders' positions, for ``fabric.save`` / ``fabric.load``.

    Put it in the state dict next to the model and optimizer; Fabric calls :meth:`state_dict` on every rank when
    saving (it gathers all ranks' states to the saving rank) and :meth:`load_state_dict` on every rank when loading.

    Args:
        loaders: the loaders returned by ``fabric.setup_dataloaders`` whose generators and epoch counts to keep.

    Restores, per rank, the python, numpy, torch (CPU and CUDA) and tracker streams, each loader's generators and
    the number of times it was iterated (Fabric's ``DistributedSampler`` epoch and the per-sample seeds follow it),
    then verifies that every rank holds its own saved state. A map-style loader saved mid-epoch keeps the batches the
    loop drew and the RNG states of the epoch's order: the next ``iter(loader)`` after loading serves the rest of the
    interrupted epoch, bitwise, also to a loop that skips the consumed batches by counting
    (:mod:`~lightning_determinism.data.fabric_epoch`). Streams (an ``IterableDataset``, litdata's
    ``StreamingDataLoader``) keep their position: saved mid-epoch, the next ``iter(loader)`` after loading continues
    the interrupted epoch at the exact sample (docs/streaming.md). A checkpoint from another world size: a warning,
    every rank reseeds from ``derive_seed(base, "resume", iterations, rank)`` and loader generators are re-derived —
    reproducible, not the uninterrupted run; never one rank's state copied to all; an interrupted map-style epoch
    starts over.

    In the world-size-invariant mode (``global_batch_size``, ``micro_batch_size``) it also keeps the batch sizes and
    the optimizer steps taken, from which the micro-batch seeds derive: a resumed loop continues the step count. The
    strategy hands it its invariant state (:attr:`invariant`) in ``fabric.save`` and ``fabric.load``.

    Attributes:
        invariant: the strategy's invariant mode, or ``None``; set by the deterministic strategies at ``fabric.save``
            and ``fabric.load``.

    Examples:
        >>> state = FabricRNGState()
        >>> sorted(state.state_dict())
        ['base_seed', 'format', 'identity', 'invariant', 'ranks', 'report', 'world_size']
    """

    def __init__(self, *loaders: Any) -> None:
        self.loaders = loaders
        self.invariant: FabricInvariantLoop | None = None

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
        invariant = self.invariant.state() if self.invariant is not None else None
        return {
            "format": _FORMAT,
            "world_size": len(ranks),
            "base_seed": -1 if base is None else int(base),
            "ranks": ranks,
            "report": determinism_report(),
            "invariant": invariant,
            "identity": fabric_identity(invariant, len(ranks)),  # the run's (Trainer: run_identity), for records
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
        if self.invariant is not None:  # the steps count over all ranks: the same on any world size
            self.invariant.load_state(state.get("invariant"))
        elif state.get("invariant") is not None:
            rank_zero_warn(
                f"`{FABRIC_STATE_KEY}` was saved in the world-size-invariant mode (global_batch_size="
                f"{state['invariant']['global_batch_size']}, micro_batch_size={state['invariant']['micro_batch_size']})"
                " and is loaded without it: this loop draws other random numbers than the run it resumes. Pass the"
                " same `global_batch_size` and `micro_batch_size` to the strategy to continue it bitwise.",
                category=DeterminismWarning,
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
            restarted = 0
            for loader, saved in zip(self.loaders, entry["loaders"], strict=True):
                position = saved.get("position") or {}
                if "skip" in position:  # a map-style epoch's count of batches means other samples here: from its start
                    _resume_at(loader, {"epoch": position["epoch"], "skip": 0, "epoch_start": None})
                    restarted += 1
            over = f" The interrupted epoch of {restarted} loader(s) starts over from its start." if restarted else ""
            rank_zero_warn(
                f"The Fabric checkpoint was written by {state['world_size']} ranks and is loaded on {world_size}: each"
                f" rank reseeds from derive_seed(base={base}, 'resume', {sum(iterations)}, rank); the run stays"
                f" reproducible but is not bitwise the uninterrupted one.{over}",
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


__all__ = ["FABRIC_STATE_KEY", "FabricRNGState"]
