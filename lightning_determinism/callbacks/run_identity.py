"""The identity of a training run: what a checkpoint records so that a resume under another configuration is said.

A checkpoint holds weights, optimizer state and loop counters, not the configuration that wrote them: a run started
with another learning rate, seed or batch size in the directory of an earlier run resumes that run's ``last.ckpt``
without a word. :func:`run_identity` is the run's configuration as a flat dict of JSON-able values (so it loads with
``torch.load(weights_only=True)`` and goes into a log record as it is); :func:`identity_changes` lists, as
``name: old -> new``, what differs between the identity saved in a checkpoint and the resuming run's.

Fields (``None`` where the run has no such setting or it is not known):

- ``base_seed``, ``world_size``; ``mesh`` (``[data_parallel, tensor_parallel]`` under ``ModelParallelStrategy``);
- ``global_batch_size``, ``micro_batch_size``, ``micro_batches_per_rank`` (``B``, ``m``, ``K``) of the
  world-size-invariant mode;
- ``optimizer`` (the class name) and ``optimizer.<name>`` for every JSON-able hyper-parameter of its parameter groups
  (``param_groups`` without ``params``); several optimizers or groups are numbered: ``optimizer[1]``,
  ``optimizer.group[1].lr``;
- ``train_samples`` (the training dataset's length) and ``train_batches`` (batches per epoch on each rank);
- ``max_epochs``, ``max_steps``, ``accumulate_grad_batches``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from lightning_determinism.callbacks._resume_layout import _mesh_shape
from lightning_determinism.seeding.seeds import current_seeds

if TYPE_CHECKING:
    import lightning.pytorch as pl

_INVARIANT = ("global_batch_size", "micro_batch_size", "micro_batches_per_rank")


def _scalar(value: Any) -> Any:
    """A JSON-able copy of a hyper-parameter (sequences as lists, one-element tensors as numbers), else ``...``.

    Any sequence: Hydra's ``instantiate`` hands an optimizer its ``betas`` as a ``ListConfig``.
    """
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, Sequence) and not isinstance(value, bytes):
        items = [_scalar(item) for item in value]
        return ... if any(item is ... for item in items) else items
    numel = getattr(value, "numel", None)
    if callable(numel) and numel() == 1 and hasattr(value, "item"):
        return _scalar(value.item())
    return ...


def optimizer_identity(optimizers: list[Any]) -> dict[str, Any]:
    """The optimizers' classes and the JSON-able hyper-parameters of their parameter groups.

    Examples:
        >>> import torch
        >>> net = torch.nn.Linear(2, 1)
        >>> optimizer_identity([torch.optim.SGD(net.parameters(), lr=0.1)])["optimizer.lr"]
        0.1
        >>> optimizer_identity([])
        {'optimizer': None}
    """
    if not optimizers:
        return {"optimizer": None}
    out: dict[str, Any] = {}
    for index, optimizer in enumerate(optimizers):
        name = "optimizer" if len(optimizers) == 1 else f"optimizer[{index}]"
        out[name] = type(optimizer).__name__
        groups = list(getattr(optimizer, "param_groups", []))
        for number, group in enumerate(groups):
            prefix = name if len(groups) == 1 else f"{name}.group[{number}]"
            for key in sorted(group):
                value = _scalar(group[key]) if key != "params" else ...
                if value is not ...:
                    out[f"{prefix}.{key}"] = value
    return out


def _data_identity(trainer: pl.Trainer) -> dict[str, Any]:
    loaders = getattr(trainer, "train_dataloader", None)  # None before the fit loop has set up its data
    if loaders is None:
        return {"train_samples": None, "train_batches": None}
    flat = list(loaders.values()) if isinstance(loaders, Mapping) else loaders
    flat = flat if isinstance(flat, (list, tuple)) else [flat]
    lengths: list[int | None] = []
    for loader in flat:
        try:
            lengths.append(len(loader.dataset))
        except (AttributeError, TypeError, NotImplementedError):
            lengths.append(None)
    batches = getattr(trainer, "num_training_batches", None)
    return {
        "train_samples": lengths[0] if len(lengths) == 1 else lengths,
        "train_batches": int(batches) if isinstance(batches, (int, float)) and math.isfinite(batches) else None,
    }


def run_identity(trainer: pl.Trainer) -> dict[str, Any]:
    """The run's configuration as a flat dict of JSON-able values (the fields are listed in the module's docstring).

    Called at ``on_fit_start`` it gives the hyper-parameters as configured; later, the optimizers' current ones (a
    scheduler's learning rate, a restored checkpoint's). The data fields are known once the fit loop has set up its
    loaders (from ``on_train_start``), ``None`` before.

    Examples:
        >>> import lightning as L
        >>> trainer = L.Trainer(max_epochs=3, logger=False, enable_progress_bar=False, enable_checkpointing=False)
        >>> identity = run_identity(trainer)
        >>> identity["world_size"], identity["max_epochs"], identity["global_batch_size"], identity["optimizer"]
        (1, 3, None, None)
    """
    strategy = getattr(trainer, "strategy", None)
    invariant = getattr(strategy, "invariant", None)
    steps = getattr(strategy, "_ldet_steps", None)
    base = getattr(steps, "base_seed", None)
    base = current_seeds()["base_seed"] if base is None else base
    state = invariant.state() if invariant is not None else {}
    identity: dict[str, Any] = {
        "base_seed": None if base is None else int(base),
        "world_size": int(trainer.world_size),
        "mesh": _mesh_shape(trainer) if strategy is not None else None,
    }
    identity.update({key: state.get(key) for key in _INVARIANT})
    identity.update(optimizer_identity(list(getattr(trainer, "optimizers", []) or [])))
    identity.update(_data_identity(trainer))
    identity["max_epochs"] = trainer.max_epochs
    identity["max_steps"] = trainer.max_steps
    identity["accumulate_grad_batches"] = int(trainer.accumulate_grad_batches)
    return identity


def fabric_identity(invariant: Mapping[str, Any] | None, world_size: int) -> dict[str, Any]:
    """A Fabric loop's identity: what its strategy knows (the base seed, the world size, the invariant ``B, m, K``).

    ``invariant``: the invariant mode's saved state (``global_batch_size``, ``micro_batch_size``), or ``None``.

    Examples:
        >>> identity = fabric_identity({"global_batch_size": 8, "micro_batch_size": 2, "step": 3}, world_size=2)
        >>> identity["global_batch_size"], identity["micro_batches_per_rank"], identity["world_size"]
        (8, 2, 2)
    """
    base = current_seeds()["base_seed"]
    identity: dict[str, Any] = {"base_seed": None if base is None else int(base), "world_size": int(world_size)}
    batch, micro = (invariant or {}).get("global_batch_size"), (invariant or {}).get("micro_batch_size")
    identity["global_batch_size"], identity["micro_batch_size"] = batch, micro
    identity["micro_batches_per_rank"] = int(batch) // int(micro) // int(world_size) if batch and micro else None
    return identity


def identity_changes(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Every field whose value differs, as ``"name: old -> new"``, in ``current``'s order, then ``saved``'s.

    A field absent on one side reads ``None`` there; the data's fields are compared only where both sides know them
    (``None`` before the fit loop has set up its loaders).

    Examples:
        >>> identity_changes({"base_seed": 3, "optimizer.lr": 0.1}, {"base_seed": 3, "optimizer.lr": 0.01})
        ['optimizer.lr: 0.1 -> 0.01']
        >>> identity_changes({"world_size": 2}, {"world_size": 2, "train_samples": None})
        []
    """
    changes = []
    for name in [*current, *(key for key in saved if key not in current)]:
        old, new = saved.get(name), current.get(name)
        if (old is None or new is None) and name in _UNKNOWN_WHEN_NONE:
            continue
        if old != new:
            changes.append(f"{name}: {old} -> {new}")
    return changes


# Fields that read None where the resuming run does not know them yet (the data before the loaders exist).
_UNKNOWN_WHEN_NONE = frozenset({"train_samples", "train_batches"})


__all__ = ["fabric_identity", "identity_changes", "optimizer_identity", "run_identity"]
