"""Where a ``DTensor``'s local shard lies in the whole tensor: the global flat index of each of its elements.

Sharding is separable by dimension (``Shard(d)``, FSDP2's chunks, uneven ones, ``_StridedShard``): each dimension's
placements applied to that dimension's positions alone give the positions this rank holds along it, computed
locally (``distribute_tensor`` with ``src_data_rank=None``: no communication) and cached by mesh, placements and
shape. The sharding-invariant digests (:mod:`.tensor_digest`) key every element by its global index from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class Positions:
    """The global flat index of each element of a shard, computed a chunk at a time (memory O(chunk)).

    ``along[d]``: the global positions along dimension ``d`` that the shard holds, in order; ``shape``: the whole
    tensor's.
    """

    def __init__(self, along: Sequence[torch.Tensor], shape: Sequence[int]) -> None:
        self.along = list(along)
        self.local_shape = [int(a.numel()) for a in self.along]
        self.global_strides = [1] * len(shape)
        for d in range(len(shape) - 2, -1, -1):
            self.global_strides[d] = self.global_strides[d + 1] * int(shape[d + 1])
        self.start = self._run_start(shape)

    def _run_start(self, shape: Sequence[int]) -> int | None:
        """Where the shard starts if it is one run ``start, start + 1, ...`` of the whole tensor, else ``None``.

        An FSDP2 chunk is one: whole rows, one after another.
        """
        if not self.along or any(a.numel() == 0 for a in self.along):
            return None
        first = self.along[0]
        for d, positions in enumerate(self.along[1:], start=1):  # every later dimension held whole, in order
            if positions.numel() != int(shape[d]) or not torch.equal(positions.cpu(), torch.arange(int(shape[d]))):
                return None
        lead = int(first[0])
        if not torch.equal(first.cpu(), torch.arange(lead, lead + first.numel())):
            return None
        return lead * self.global_strides[0]

    def of(self, elements: torch.Tensor) -> torch.Tensor:
        """The global flat indices of the shard's elements ``elements`` (row-major local flat indices)."""
        index = torch.zeros_like(elements)
        rest = elements
        for d in range(len(self.along) - 1, -1, -1):
            size = self.local_shape[d]
            index += self.along[d].to(elements.device)[rest % size] * self.global_strides[d]
            rest = rest // size
        return index


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (without importing torch.distributed.tensor)."""
    return type(tensor).__name__ == "DTensor" and hasattr(tensor, "placements")


def splits(placement: Any) -> bool:
    """Whether a placement splits the tensor (``Shard``, or FSDP2 x tensor parallel's ``_StridedShard``)."""
    from lightning_determinism._compat.access import is_strided_shard

    return bool(placement.is_shard() or is_strided_shard(placement))


_MESHES: dict[int, tuple[Any, tuple[int, ...], tuple[int, ...]]] = {}  # by id: the mesh itself, its shape, ranks


def mesh_layout(mesh: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A device mesh's shape and its global ranks in the mesh's order, read once per mesh.

    ``DeviceMesh.mesh`` rebuilds its rank tensor from the layout on every read (150 µs in torch 2.13).
    """
    found = _MESHES.get(id(mesh))
    if found is None or found[0] is not mesh:  # kept beside its id: an id is not reused while the mesh lives
        if len(_MESHES) >= 256:
            _MESHES.clear()
        ranks = mesh.mesh
        found = _MESHES[id(mesh)] = (mesh, tuple(ranks.shape), tuple(ranks.flatten().tolist()))
    return found[1], found[2]


_POSITIONS: dict[Any, Positions] = {}  # by (mesh, placements, shape): a model's layouts repeat every step
_POSITIONS_KEPT = 4096


def global_index(tensor: Any) -> Positions:
    """Where this rank's shard lies in the whole tensor, per dimension (no communication; O(size of a dimension)).

    Cached by mesh, placements and shape (the shard's place depends on nothing else).
    """
    mesh = tensor.device_mesh
    key = (*mesh_layout(mesh), tuple(mesh.get_coordinate() or ()), tuple(tensor.placements), tuple(tensor.shape),
           str(tensor.device))  # fmt: skip
    found = _POSITIONS.get(key)
    if found is None:
        if len(_POSITIONS) >= _POSITIONS_KEPT:
            _POSITIONS.clear()
        found = _POSITIONS[key] = _compute_global_index(tensor)
    return found


def _compute_global_index(tensor: Any) -> Positions:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from lightning_determinism._compat.access import dtensor_local, is_strided_shard, strided_shard_like

    local = dtensor_local(tensor)
    shape = tuple(tensor.shape)
    along = []
    for d in range(len(shape)):
        cut = [i for i, p in enumerate(tensor.placements) if splits(p) and p.dim % max(len(shape), 1) == d]
        positions = torch.arange(shape[d], dtype=torch.int64, device=local.device)
        if cut:  # this dimension's placements applied to its positions alone (sharding is separable by dimension)
            placements = [
                (strided_shard_like(p, 0) if is_strided_shard(p) else Shard(0)) if i in cut else Replicate()
                for i, p in enumerate(tensor.placements)
            ]
            positions = dtensor_local(distribute_tensor(positions, tensor.device_mesh, placements, src_data_rank=None))
        along.append(positions)
    return Positions(along, shape)


def owns(tensor: Any) -> bool:
    """Whether this rank adds its shard: the first replica along every dimension the tensor is replicated on."""
    coordinate = tensor.device_mesh.get_coordinate()
    if coordinate is None:
        return False
    return all(splits(p) or c == 0 for p, c in zip(tensor.placements, coordinate, strict=True))


def without_partial(tensor: Any) -> Any:
    """A ``DTensor`` with pending reductions (``Partial``) reduced: their sum is its value (a collective)."""
    if not is_dtensor(tensor) or not any(p.is_partial() for p in tensor.placements):
        return tensor
    from torch.distributed.tensor import Replicate

    return tensor.redistribute(placements=[Replicate() if p.is_partial() else p for p in tensor.placements])


__all__ = ["Positions", "global_index", "is_dtensor", "mesh_layout", "owns", "splits", "without_partial"]
