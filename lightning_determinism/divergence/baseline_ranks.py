"""What every rank contributes to a baseline step: whole-tensor norms, the loss and the replicas' check, the costs.

Each function is called on every rank (the collectives are the recorder's: one or none per call).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from lightning_determinism.divergence.tensor_digest import full_norms, is_dtensor
from lightning_determinism.exact import exact_mean, normalize
from lightning_determinism.seeding.seeds import _rank_and_world_size


def distributed() -> bool:
    """Whether a process group of more than one rank is running."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's global rank (0 without a process group)."""
    return _rank_and_world_size()[0]


def _exact_mean(totals: torch.Tensor) -> float:
    """The mean from summed ``[limbs (3), count, unusable]``; NaN when a term was unusable or there was none."""
    if int(totals[4]) > 0:
        return float("nan")
    return exact_mean(normalize(totals[:3]), totals[3])


def step_over_ranks(
    limbs: torch.Tensor, count: int, unusable: int, named: list[tuple[str, torch.nn.Parameter]], record: dict[str, Any]
) -> tuple[float, dict[str, Any]]:
    """The step's loss over all ranks and the replicas' disagreements, from one ``all_gather`` (none on one process).

    The loss: the mean of every rank's terms from each rank's exact sum and counts (int64, summed here in any
    order: the same bits on any world size); NaN when a rank had no term, or one that was not finite or too large
    for the exact sum. The disagreements: every rank's norm of each parameter held whole on every rank (DDP's
    replicas, what tensor parallel leaves as plain tensors), where the ranks' bits differ: a skipped all-reduce shows
    here at its step and parameter, whichever rank it hit.
    """
    totals = torch.cat((limbs, torch.tensor([count, unusable], dtype=torch.int64)))
    if not distributed():
        return _exact_mean(totals), {}
    keys = [f"{group}[{name}]" for group in ("grad_norms", "param_norms") for name, p in named if not is_dtensor(p)]
    values = [record[key.split("[", 1)[0]].get(key.split("[", 1)[1][:-1]) for key in keys]
    norms = torch.tensor([math.nan if v is None else v for v in values], dtype=torch.float64)
    mine = torch.cat((totals.view(torch.float64), norms))  # the counts' bits travel as float64 words, untouched
    if dist.get_backend() == "nccl":
        mine = mine.cuda()
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    rows = torch.stack([g.cpu() for g in gathered])  # ranks x (5 + keys)
    loss = _exact_mean(rows[:, :5].contiguous().view(torch.int64).sum(dim=0))
    table = rows[:, 5:]
    bits = table.contiguous().view(torch.int64)
    differ = (bits != bits[:1]).any(dim=0)
    by_rank = {
        key: [None if math.isnan(v) else v for v in table[:, i].tolist()] for i, key in enumerate(keys) if differ[i]
    }
    return loss, by_rank


def device_of(module: torch.nn.Module) -> torch.device:
    """Where a module's first parameter lives (CPU for a module without parameters)."""
    first = next(iter(module.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


def whole_norms(tensors: list[Any]) -> list[float | None]:
    """Each whole tensor's 2-norm (``None`` for ``None``), in float64.

    A ``DTensor``'s by :func:`full_norms` (one collective for all, no gather); a plain tensor's by ``Tensor.norm``, as
    format 1 did (its bits unchanged: files recorded before still compare bitwise with today's runs).
    """
    sharded = [t for t in tensors if t is not None and is_dtensor(t)]
    found = iter(full_norms(sharded))
    return [None if t is None else next(found) if is_dtensor(t) else _norm(t) for t in tensors]


def _norm(tensor: torch.Tensor) -> float:
    """``float(tensor.double().norm())`` (format 1's bits) without the float64 copy: the norm upcasts as it reads."""
    return float(torch.linalg.vector_norm(tensor.detach(), dtype=torch.float64))


def gather_costs(costs: list[tuple[int, float | None]], steps: int) -> list[list[tuple[float, float]]]:
    """Every rank's ``(peak bytes, communication seconds)`` per step (NaN where there is none), rank by rank."""
    rows = [(float(c[0]), math.nan if c[1] is None else float(c[1])) for c in costs[:steps]]
    rows += [(math.nan, math.nan)] * (steps - len(rows))
    mine = torch.tensor(rows, dtype=torch.float64).reshape(steps, 2)
    if not distributed():
        return [[(float(a), float(b)) for a, b in mine.tolist()]]
    if dist.get_backend() == "nccl":
        mine = mine.cuda()
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return [[(float(a), float(b)) for a, b in g.cpu().tolist()] for g in gathered]


__all__ = ["device_of", "distributed", "gather_costs", "rank", "step_over_ranks", "whole_norms"]
