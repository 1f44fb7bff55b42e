"""What the determinism record holds, and how it reaches a logger: shared by the Trainer callback and Fabric's helper.

The entries (flat ``determinism/...`` keys, see :mod:`~lightning_determinism.divergence.run_record`):

- ``seed``, ``seed_source`` (``given``, ``seed_everything`` or ``drawn``: on rank 0, then broadcast),
  ``seed_everything`` (its seed, where it ran: it seeds a model built before the strategy's own seed), ``debug_mode``,
  ``world_size``, ``strategy``, ``precision``;
- ``mesh/<dimension>`` (a device mesh's sizes), ``topology/<axis>`` (the strategies' ``topology=`` degrees),
  ``invariant/global_batch_size``, ``invariant/micro_batch_size``, ``invariant/micro_batches_per_rank`` (B, m, K);
  ``batch_invariant`` (``True`` where evaluation runs batch-invariantly, absent otherwise);
- ``version/<package>`` (python, torch, lightning, numpy, torchmetrics, lightning_determinism), ``backend/<flag>``
  (:func:`~lightning_determinism.determinism_report`'s flags);
- ``rank_<r>/local_seed`` and ``rank_<r>/<stream>``: a digest (16 hex digits of a sha256) of each stream rank ``r``
  draws from at the start (``cpu``: python, numpy and torch; ``cuda``, ``tracker``, ``generators`` where present),
  gathered to rank 0 in one collective; ``streams/equal_ranks``: the ranks whose CPU streams are equal;
- ``run/<field>``: the run's identity (:func:`~lightning_determinism.callbacks.run_identity.run_identity`, what a
  checkpoint records) but the fields above.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lightning_determinism._compat.access import device_mesh_of
from lightning_determinism.divergence.fingerprint import fingerprint
from lightning_determinism.divergence.run_record import PREFIX, flat
from lightning_determinism.divergence.tensor_digest import is_dtensor
from lightning_determinism.seeding.backends import determinism_report
from lightning_determinism.seeding.rank_states import all_gather, pattern
from lightning_determinism.seeding.rng import capture_cpu_streams, get_rng_tracker, named_generator_states
from lightning_determinism.seeding.seeds import current_seeds

_VERSIONS = ("python", "torch", "lightning", "numpy", "torchmetrics", "lightning_determinism")
_NOT_FLAGS = {*_VERSIONS, "pl_global_seed", "base_seed", "local_seed", "rank", "world_size"}
# Identity fields the record has under its own names.
_RECORDED = {"base_seed", "world_size", "mesh", "global_batch_size", "micro_batch_size", "micro_batches_per_rank"}
_DIGITS = 16


def _digest(named: Mapping[str, Any]) -> str:
    """sha256 over names and tensor bytes (or reprs), 16 hex digits: equal streams, equal digests."""
    h = hashlib.sha256()
    for name in sorted(named):
        value = named[name]
        h.update(name.encode())
        if isinstance(value, torch.Tensor):
            h.update(value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(value, Mapping):
            h.update(_digest(value).encode())
        else:
            h.update(repr(value).encode())
    return h.hexdigest()[:_DIGITS]


def local_streams() -> dict[str, Any]:
    """This rank's seed and a digest of each stream it draws from (never the states themselves).

    Examples:
        >>> from lightning_determinism import set_seed
        >>> _ = set_seed(3)
        >>> a = local_streams()
        >>> _ = set_seed(3)
        >>> a == local_streams(), sorted(a)
        (True, ['cpu', 'local_seed'])
    """
    cpu = capture_cpu_streams()
    out: dict[str, Any] = {
        "local_seed": current_seeds()["local_seed"],
        "cpu": _digest({"python": cpu["python"]["state"], "numpy": cpu["numpy"]["state"], "torch": cpu["torch"]}),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = _digest({str(i): state for i, state in enumerate(torch.cuda.get_rng_state_all())})
    tracker = get_rng_tracker().get_states()
    if tracker:
        out["tracker"] = _digest(tracker)
    generators = named_generator_states()
    if generators:
        out["generators"] = _digest(generators)
    return out


def gather_streams() -> list[dict[str, Any]]:
    """Every rank's :func:`local_streams`, on every rank (one ``all_gather_object``; call it on every rank)."""
    return all_gather(local_streams())


def _mesh(strategy: Any) -> dict[str, int] | None:
    mesh = device_mesh_of(strategy)
    if mesh is None:
        return None
    names = getattr(mesh, "mesh_dim_names", None) or [f"dim_{i}" for i in range(len(mesh.shape))]
    return {str(name): int(size) for name, size in zip(names, mesh.shape, strict=True)}


def _degrees(topology: Any) -> dict[str, int] | None:
    """A :class:`~lightning_determinism.parallel.topology.Topology`'s degrees (``dp``, ``pp``, ``mp``, ...)."""
    return None if topology is None else {str(axis): int(size) for axis, size in topology.degrees.items()}


def _seed_everything(steps: Any, report: Mapping[str, Any]) -> int | None:
    """The ``PL_GLOBAL_SEED`` in effect before the strategy exported its own (``None``: ``seed_everything`` not run)."""
    saved = getattr(steps, "saved_env", None)
    value = saved.get("PL_GLOBAL_SEED") if saved is not None and "PL_GLOBAL_SEED" in saved else report["pl_global_seed"]
    try:
        return None if value is None else int(value)
    except ValueError:
        return None


def build_record(
    strategy: Any, ranks: Sequence[Mapping[str, Any]], identity: Mapping[str, Any], precision: Any = None
) -> dict[str, Any]:
    """The record as flat ``determinism/...`` entries (see the module's docstring), from what rank 0 knows.

    Args:
        strategy: the run's strategy (a deterministic one tells the seed's source, the debug mode, B/m/K).
        ranks: :func:`gather_streams`.
        identity: the run's identity (``run_identity(trainer)``, or what a Fabric loop knows).
        precision: the precision setting, e.g. ``"32-true"``.
    """
    steps = getattr(strategy, "_ldet_steps", None)
    report = determinism_report()
    seed = getattr(steps, "base_seed", None)
    seed = seed if seed is not None else identity.get("base_seed", current_seeds()["base_seed"])
    invariant = getattr(strategy, "invariant", None) or getattr(getattr(strategy, "_ldet_invariant", None),
                                                                "invariant", None)  # fmt: skip
    record: dict[str, Any] = {
        "seed": seed,
        "seed_source": getattr(steps, "seed_source", None)
        or ("seed_everything" if report["pl_global_seed"] is not None else None),
        # seed_everything's seed (LightningCLI's `seed_everything:`), which seeds what the model builds before the
        # strategy runs, even where the strategy has a seed of its own: a difference there is named.
        "seed_everything": _seed_everything(steps, report),
        "debug_mode": getattr(strategy, "debug_mode", None),
        "world_size": len(ranks),
        "strategy": type(strategy).__name__,
        "precision": None if precision is None else str(precision),
        "mesh": _mesh(strategy),
        "topology": _degrees(getattr(steps, "topology", None)),
        "invariant": None if invariant is None else invariant.state(),
        "batch_invariant": getattr(strategy, "batch_invariant", None) or None,  # absent when off: older records agree
        "version": {name: report[name] for name in _VERSIONS},
        "backend": {key: value for key, value in report.items() if key not in _NOT_FLAGS},
        **{f"rank_{rank}": dict(streams) for rank, streams in enumerate(ranks)},
        "streams": {"equal_ranks": str(pattern([str(streams.get("cpu")) for streams in ranks]))},
    }
    return {**flat(record), **run_entries(identity)}


def run_entries(identity: Mapping[str, Any]) -> dict[str, Any]:
    """The identity's fields as ``determinism/run/<field>`` entries, but those the record has under its own names.

    Examples:
        >>> run_entries({"base_seed": 3, "optimizer": "SGD", "optimizer.lr": 0.1, "train_samples": None})
        {'determinism/run/optimizer': 'SGD', 'determinism/run/optimizer.lr': 0.1}
    """
    return flat({key: value for key, value in identity.items() if key not in _RECORDED}, f"{PREFIX}run/")


def needs_every_rank(model: torch.nn.Module) -> bool:
    """Whether the model's fingerprint is a collective (sharded ``DTensor`` parameters or buffers)."""
    return any(is_dtensor(t) for t in (*model.parameters(), *model.buffers()))


def model_fingerprint(model: torch.nn.Module, rank: int, state_dict: Any = None) -> str | None:
    """The whole model's fingerprint on rank 0 (``None`` on the others): sharded ones digested where they live.

    Call it on every rank: with ``DTensor`` parameters (FSDP2, tensor parallel) every rank takes part; otherwise
    only rank 0 computes it. ``state_dict`` (a callable), where given, replaces ``model.state_dict()`` (FSDP1: the
    strategy's gathered one, a collective too).
    """
    if state_dict is not None:
        state = state_dict()
        return fingerprint(state) if rank == 0 else None
    if rank != 0 and not needs_every_rank(model):
        return None
    value = fingerprint(model)
    return value if rank == 0 else None


__all__ = ["build_record", "gather_streams", "local_streams", "model_fingerprint", "needs_every_rank", "run_entries"]
