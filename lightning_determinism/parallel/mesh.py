"""The seeding rule on a device mesh: Lightning's ``ModelParallelStrategy`` mesh as a :class:`Topology`.

Lightning's ``ModelParallelStrategy`` lays its processes out on a 2-D mesh ``("data_parallel", "tensor_parallel")``,
the tensor-parallel dimension varying fastest: global rank ``r`` is data-parallel coordinate ``r // tp`` and
tensor-parallel coordinate ``r % tp``. That is :class:`~lightning_determinism.parallel.topology.Topology` with
``mp_degree=tp`` (``dp`` inferred), whose seed streams then give:

- initialisation (``configure_model``) runs under the base seed on every rank: the sharded model, gathered, is the
  one-process model;
- the default streams (python, numpy, torch: dropout on a replicated activation) are equal on tensor-parallel peers,
  so the tensors they replicate stay bitwise equal, and distinct across data-parallel ranks, whose samples differ;
- ``get_rng_tracker().fork()`` (dropout on a tensor-parallel shard) is distinct on every (data-parallel,
  tensor-parallel) coordinate.

A reduction's bits also depend on the number of intra-op threads (LayerNorm's backward sums in another order with
1 thread than with 2), and Lightning's popen launcher leaves the process it runs in (rank 0) with every core while
its child ranks get their share: :func:`equalize_threads` gives every rank the smallest count any rank has.

DTensor random ops draw the whole tensor's numbers from the current stream and keep the shard's slice
(:mod:`~lightning_determinism.parallel.dtensor_random`): under this rule a tensor-parallel shard holds exactly what
one device draws for it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_info

from lightning_determinism._process import distributed
from lightning_determinism.parallel import dtensor_random
from lightning_determinism.parallel.topology import Topology

MESH_DIMS = ("data_parallel", "tensor_parallel")


def mesh_topology(mesh: Any, rank: int, world_size: int) -> dict[str, int]:
    """The degrees of :class:`Topology` that place every rank where ``mesh`` (Lightning's) places it.

    Raises:
        ValueError: for a mesh whose dimensions are not Lightning's ``("data_parallel", "tensor_parallel")`` or whose
            coordinates differ from the topology's (naming this rank's coordinates in both).

    Examples:
        >>> class Mesh:  # what Lightning builds for 4 ranks with tensor_parallel_size=2, seen from rank 3
        ...     mesh_dim_names = ("data_parallel", "tensor_parallel")
        ...     shape = (2, 2)
        ...     def get_coordinate(self):
        ...         return [1, 1]
        >>> mesh_topology(Mesh(), rank=3, world_size=4)
        {'mp_degree': 2}
    """
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if names != MESH_DIMS:
        raise ValueError(
            f"[rank: {rank}] the strategy's device mesh has dimensions {names}; the deterministic seeding rule knows"
            f" Lightning's {MESH_DIMS} (pass `topology=` degrees for another layout)"
        )
    tp = int(mesh.shape[1])
    spec = {"mp_degree": tp}
    coordinates = Topology(rank, world_size, mp_degree=tp).coordinates
    mesh_at = [int(c) for c in mesh.get_coordinate()]
    if mesh_at != [coordinates["dp"], coordinates["mp"]]:
        raise ValueError(
            f"[rank: {rank}] the device mesh places this rank at data_parallel={mesh_at[0]},"
            f" tensor_parallel={mesh_at[1]}, the topology at dp={coordinates['dp']}, mp={coordinates['mp']}"
        )
    return spec


def follow_mesh(steps: Any, mesh: Any, rank: int, world_size: int) -> None:
    """Give a strategy's ``SeedingSteps`` the mesh's rule (before the ranks are known to it) and equal threads.

    DTensor random ops are routed to draw the one-device numbers (:mod:`.dtensor_random`).

    Raises:
        ValueError: for a ``topology`` the user gave that contradicts the mesh, or a mesh of other dimensions.
    """
    spec = mesh_topology(mesh, rank, world_size)
    given = steps.topology_spec
    if given is not None and (not isinstance(given, dict) or given != spec):
        raise ValueError(
            f"[rank: {rank}] `topology={given!r}` contradicts the strategy's device mesh {spec} (data_parallel x"
            " tensor_parallel): pass no `topology`, the mesh sets it"
        )
    steps.topology_spec = spec
    steps.distinct_data_parallel = True
    steps.dtensor_random_routed = bool(dtensor_random.install(mesh))  # undone by steps.restore_env()
    threads = equalize_threads()
    rank_zero_info(f"lightning_determinism: every rank computes with {threads} intra-op thread(s)")


def equalize_threads() -> int:
    """Give every rank the smallest intra-op thread count of any rank (collective); returns it."""
    threads = torch.tensor([torch.get_num_threads()], dtype=torch.int64)
    if distributed():
        dist.all_reduce(threads, op=dist.ReduceOp.MIN)
    count = int(threads.item())
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)
    return count


__all__ = ["MESH_DIMS", "equalize_threads", "follow_mesh", "mesh_topology"]
