"""What FSDP2 does wrong on older torch releases, put right or refused when a model-parallel strategy sets a model up.

- torch 2.8 asks gloo's reduce-scatter for ``ReduceOp.AVG``, which gloo takes for a sum there: every gradient of a
  ``fully_shard``-ed model comes back ``world_size`` times too large. :func:`average_over_gloo` makes its modules sum
  and divide instead (``set_force_sum_reduction_for_comms``, FSDP2's own path for backends without an average).
- torch before 2.10 redistributes a parameter that FSDP2 shards over tensor parallel (a ``_StridedShard``) into wrong
  values when its dimension does not divide by the shards (10 rows over 2 x 2): ``full_tensor()``, and every norm,
  digest or gather made from it. Training itself is unaffected, but nothing can show it right, so
  :func:`refuse_uneven_strided_shards` refuses such a model in one line (:data:`~lightning_determinism._compat.checks.
  UNEVEN_STRIDED`); an even split, or torch 2.10, runs.

Layer: ``parallel``; imports the leaves (``_compat``) only.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_determinism._compat.access import is_strided_shard
from lightning_determinism._compat.checks import versions
from lightning_determinism._compat.features import FEATURES, UNEVEN_STRIDED
from lightning_determinism._compat.pieces import _release
from lightning_determinism.errors import IncompatibleVersionError

TORCH_RELEASE = _release(torch.__version__)[:2]


def _fsdp_modules(module: torch.nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def average_over_gloo(module: torch.nn.Module) -> int:
    """Make stock FSDP2 average its gradients over gloo on torch 2.8, where it silently sums them.

    Nothing is done on torch 2.9 and newer, on other backends or without a process group.

    Returns:
        How many ``FSDPModule``s were told to sum and divide.
    """
    if TORCH_RELEASE >= (2, 9) or not dist.is_available() or not dist.is_initialized():
        return 0
    if dist.get_backend() != "gloo":
        return 0
    modules = _fsdp_modules(module)
    for fsdp_module in modules:
        fsdp_module.set_force_sum_reduction_for_comms(True)
    return len(modules)


def uneven_strided_shards(module: torch.nn.Module) -> list[str]:
    """The parameters of ``module`` placed with a ``_StridedShard`` on a dimension the shards do not divide evenly.

    Each as ``"name: dimension d of n over k shards"``.
    """
    found = []
    for name, parameter in module.named_parameters():
        placements = getattr(parameter, "placements", None)
        mesh = getattr(parameter, "device_mesh", None)
        if not placements or mesh is None or not any(is_strided_shard(p) for p in placements):
            continue
        shards: dict[int, int] = {}
        for mesh_dim, placement in enumerate(placements):
            dim = getattr(placement, "dim", None)
            if dim is not None and (is_strided_shard(placement) or placement.is_shard()):
                shards[dim] = shards.get(dim, 1) * mesh.size(mesh_dim)
        for dim, count in sorted(shards.items()):
            if parameter.shape[dim] % count:
                found.append(f"{name}: dimension {dim} of {parameter.shape[dim]} over {count} shards")
    return found


def refuse_uneven_strided_shards(module: torch.nn.Module) -> None:
    """On torch before 2.10, refuse a model with :func:`uneven_strided_shards` (one line; nothing on 2.10 and newer).

    Raises:
        IncompatibleVersionError: naming the first such parameter, the installed versions and where it works.
    """
    if TORCH_RELEASE >= (2, 10):
        return
    found = uneven_strided_shards(module)
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise IncompatibleVersionError(
            f"lightning_determinism: {UNEVEN_STRIDED} cannot run with the installed {versions()}: {found[0]}{more}"
            f" (it works with {FEATURES[UNEVEN_STRIDED]}); make that dimension divisible by the shards, or upgrade"
            " torch"
        )


__all__ = ["TORCH_RELEASE", "average_over_gloo", "refuse_uneven_strided_shards", "uneven_strided_shards"]
