"""DTensor random ops that draw what one device draws: each shard gets its slice of the whole tensor's numbers.

Stock DTensor (torch 2.13) runs a random op on a CPU mesh on the local shard with the local generator: every shard
draws the numbers of the tensor's first slice (the same mask on both halves of a ``Shard(1)`` activation), and the
mask depends on the tensor-parallel degree and the shard dimension. On CUDA its RNG tracker, created at the first
random op, broadcasts rank 0's generator state to every rank: per-rank seeds (data-parallel ranks' own masks) are
undone, and its offset scheme is not the one-device stream either (pytorch#168058).

:func:`install` replaces those ops (dropout's ``bernoulli_``, ``uniform_``, ``normal_``, ``rand_like``, and the in-place
samplers ``exponential_``, ``log_normal_``, ``geometric_``, ``cauchy_``, ``random_``, ...) on
DTensors by one rule, on every device: draw the whole tensor, as one device would, from the current stream, and keep
this rank's part. Under the mesh's seeding rule the default stream is shared by tensor-parallel peers, so a
``Shard`` DTensor holds exactly its slice of the one-device draw, whatever the degree or the shard dimension, and a
``Replicate`` one the same numbers on every peer; the generator then stands where one device's would. The price is
the whole tensor's draw (and memory) on every rank instead of its shard's: measured in ``benchmarks/dtensor_random.py``.
No communication: the local part is cut out of the whole locally (``distribute_tensor(..., src_data_rank=None)``,
which handles uneven and strided FSDP2 x tensor-parallel shards).

What stays exact, and what does not:

- a tensor sharded over dimensions whose ranks share the stream (tensor parallel in training; every dimension in
  ``configure_model``, which runs under the base seed everywhere, so the meta-device path ``to_empty`` +
  ``reset_parameters`` initialises exactly the one-process model): bitwise the one-device draw;
- a tensor sharded over data-parallel ranks in training (their streams differ by design): each rank's slice of its
  own stream's whole draw;
- a ``Partial`` placement or a meta tensor: the local op, as stock.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from lightning_determinism._compat.access import (
    dtensor_local,
    dtensor_op_handlers,
    dtensor_random_ops,
    keep_dtensor_tracker_from_syncing,
    wrap_dtensor,
)
from lightning_determinism._compat.checks import require
from lightning_determinism._compat.features import DTENSOR

_aten = torch.ops.aten
SAMPLERS = (
    _aten.exponential_.default,
    _aten.log_normal_.default,
    _aten.geometric_.default,
    _aten.cauchy_.default,
    _aten.random_.default,
    getattr(_aten.random_, "from"),
    _aten.random_.to,
)
"""In-place samplers DTensor does not count as random: stock, on a shard, each would draw the first slice's numbers
(or have no sharding rule at all); routed like the others, whether or not this torch knows them as random."""
VALUE_FREE = (
    _aten.uniform_.default,
    _aten.normal_.default,
    _aten.bernoulli_.float,
    _aten.rand_like.default,
    _aten.randn_like.default,
    _aten.randint_like.default,
    _aten.randint_like.low_dtype,
    *SAMPLERS,
)
"""Ops whose draws depend on the tensor's shape and dtype only: the whole tensor need not hold this rank's values."""
IN_PLACE = (_aten.uniform_.default, _aten.normal_.default, _aten.bernoulli_.float, *SAMPLERS)
VALUE_DEPENDENT = (_aten.native_dropout.default, _aten.bernoulli.default)
"""Ops that read the values (dropout's input, bernoulli's probabilities): the whole tensor holds this rank's part."""
HANDLED = VALUE_FREE + VALUE_DEPENDENT

_saved: dict[Any, Callable[..., Any] | None] = {}  # the handlers install() replaced, restored by uninstall()


def install(mesh: Any = None) -> list[Any]:
    """Route DTensor random ops through :func:`draw_whole` (process-wide, idempotent); returns the ops routed.

    Args:
        mesh: the run's device mesh; on a CUDA mesh DTensor's tracker is created now without its rank-0 state sync
            (it is then never asked for the routed ops; its ``rand``/``randn`` factories keep each rank's state).
    """
    require(DTENSOR)
    handlers = dtensor_op_handlers()
    random_ops = dtensor_random_ops()
    routed = [op for op in HANDLED if op in random_ops or op in SAMPLERS]
    for op in routed:
        if handlers.get(op) is not draw_whole:
            _saved.setdefault(op, handlers.get(op))
            handlers[op] = draw_whole
    if mesh is not None:
        keep_dtensor_tracker_from_syncing(mesh)
    return routed


def uninstall() -> None:
    """Put back DTensor's own handling of random ops."""
    handlers = dtensor_op_handlers()
    for op, previous in _saved.items():
        if previous is None:
            handlers.pop(op, None)
        else:
            handlers[op] = previous
    _saved.clear()


def installed() -> bool:
    """Whether DTensor random ops are routed through :func:`draw_whole`."""
    return any(handler is draw_whole for handler in dtensor_op_handlers().values())


def _whole_holding(tensor: DTensor) -> torch.Tensor:
    """The whole tensor with this rank's part in place and zeros elsewhere (no communication)."""
    local = dtensor_local(tensor)
    if all(isinstance(p, Replicate) for p in tensor.placements):
        return local
    whole = torch.zeros(tensor.shape, dtype=local.dtype, device=local.device)
    index = torch.arange(whole.numel(), device=local.device).view(tensor.shape)
    mine = dtensor_local(_part(index, tensor))
    whole.view(-1)[mine.reshape(-1)] = local.reshape(-1)
    return whole


def _part(whole: torch.Tensor, like: DTensor) -> DTensor:
    """This rank's part of ``whole``, placed as ``like`` (no communication)."""
    return distribute_tensor(whole, like.device_mesh, like.placements, src_data_rank=None)


def draw_whole(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A random op on a DTensor: the whole tensor's draw from the current stream, this rank's part kept.

    Installed as DTensor's handler for the ops in :data:`HANDLED` (see the module's docstring for what is exact).
    """
    tensor = args[0]
    local = dtensor_local(tensor)
    kwargs = dict(kwargs or {})
    if local.is_meta or any(p.is_partial() for p in tensor.placements):
        return _local_op(op, tensor, args, kwargs)
    rest = args[1:]
    if op in VALUE_FREE:
        whole = torch.empty_strided(tensor.shape, tensor.stride(), dtype=local.dtype, device=local.device)
        result = op(whole, *rest, **kwargs)
        if op in IN_PLACE:  # in place: this rank's part of the whole draw into the shard
            local.copy_(dtensor_local(_part(whole, tensor)))
            return tensor
        return _part(result, tensor)
    results = op(_whole_holding(tensor), *rest, **kwargs)
    if isinstance(results, tuple):
        return tuple(_part(result, tensor) for result in results)
    return _part(results, tensor)


def _local_op(op: Any, tensor: DTensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Stock behaviour on the local tensor (meta tensors, ``Partial`` placements)."""
    results = op(dtensor_local(tensor), *args[1:], **kwargs)
    if op in IN_PLACE:
        return tensor
    if isinstance(results, tuple):
        return tuple(wrap_dtensor(result, tensor) for result in results)
    return wrap_dtensor(results, tensor)


__all__ = [
    "HANDLED",
    "IN_PLACE",
    "SAMPLERS",
    "VALUE_DEPENDENT",
    "VALUE_FREE",
    "draw_whole",
    "install",
    "installed",
    "uninstall",
]
