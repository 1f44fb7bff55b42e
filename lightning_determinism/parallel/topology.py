"""Parallel topology: global rank -> coordinates on the dp / pp / sharding / mp / sep axes, and seed streams.

This module is a leaf: it knows ``torch.distributed``, not Lightning's strategies.

Ranks are laid out row-major over ``order``: the last axis varies fastest. With the default order
``("dp", "pp", "sharding", "mp", "sep")`` model-parallel peers are neighbouring ranks (one node), data-parallel
replicas are far apart.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_determinism.seeding.rng import DEFAULT_STREAM, RNGStatesTracker, get_rng_tracker
from lightning_determinism.seeding.seeds import _record_seeds, check_seed, derive_seed, seed_all

AXES = ("dp", "pp", "sharding", "mp", "sep")


@dataclass(frozen=True)
class GroupInfo:
    """One process group of a topology, seen from one rank.

    Attributes:
        size: number of ranks in the group.
        rank: this rank's index in the group.
        world: the group's global ranks, ordered by their index in the group.
    """

    size: int
    rank: int
    world: tuple[int, ...]


def _check_degree(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}")
    return value


class Topology:
    """Where global rank ``device_rank`` sits among ``world_size`` ranks split over five parallel axes.

    Args:
        device_rank: this process's global rank, in ``[0, world_size)``.
        world_size: number of processes.
        dp_degree: data-parallel replicas; ``None`` infers ``world_size / (pp * sharding * mp * sep)``.
        pp_degree: pipeline stages.
        sharding_degree: sharded data-parallel ranks (ZeRO/FSDP); they see different data, like dp replicas.
        mp_degree: tensor (model) parallel ranks.
        sep_degree: sequence/context parallel ranks.
        order: the axes from slowest to fastest varying; a permutation of ``("dp", "pp", "sharding", "mp", "sep")``.

    Raises:
        ValueError: for degrees that are not positive ints or do not multiply to ``world_size``, a rank outside
            ``[0, world_size)``, or an ``order`` that is not a permutation of the five axes.

    Examples:
        >>> topo = Topology(device_rank=3, world_size=4, mp_degree=2)
        >>> topo
        Topology(rank=3, world_size=4, dp=2, pp=1, sharding=1, mp=2, sep=1, order=dp,pp,sharding,mp,sep)
        >>> topo.dp_info, topo.mp_info.world
        (GroupInfo(size=2, rank=1, world=(1, 3)), (2, 3))
    """

    def __init__(
        self,
        device_rank: int,
        world_size: int,
        dp_degree: int | None = None,
        pp_degree: int = 1,
        sharding_degree: int = 1,
        mp_degree: int = 1,
        sep_degree: int = 1,
        order: Sequence[str] = AXES,
    ) -> None:
        world_size = _check_degree("world_size", world_size)
        if isinstance(device_rank, bool) or not isinstance(device_rank, int) or not 0 <= device_rank < world_size:
            raise ValueError(
                f"`device_rank` must be in [0, {world_size}) for world_size={world_size}, got {device_rank}"
            )
        order = tuple(order)
        if sorted(order) != sorted(AXES):
            raise ValueError(f"`order` must be a permutation of {AXES}, got {order}")
        degrees = {
            "pp": _check_degree("pp_degree", pp_degree),
            "sharding": _check_degree("sharding_degree", sharding_degree),
            "mp": _check_degree("mp_degree", mp_degree),
            "sep": _check_degree("sep_degree", sep_degree),
        }
        others = math.prod(degrees.values())
        if dp_degree is None:
            if world_size % others:
                raise ValueError(
                    f"cannot infer `dp_degree`: world_size={world_size} is not divisible by"
                    f" pp*sharding*mp*sep={others} ({degrees})"
                )
            dp_degree = world_size // others
        degrees["dp"] = _check_degree("dp_degree", dp_degree)
        if degrees["dp"] * others != world_size:
            raise ValueError(
                f"degrees must multiply to world_size={world_size}, got dp={degrees['dp']} * pp={degrees['pp']} *"
                f" sharding={degrees['sharding']} * mp={degrees['mp']} * sep={degrees['sep']}"
                f" = {degrees['dp'] * others}"
            )
        self.rank = device_rank
        self.world_size = world_size
        self.order = order
        self.degrees = {axis: degrees[axis] for axis in AXES}
        self.shape = tuple(self.degrees[axis] for axis in order)
        self.coordinates = self.coordinates_of(device_rank)

    def coordinates_of(self, rank: int) -> dict[str, int]:
        """The coordinate of global ``rank`` on every axis."""
        coords = {}
        for axis, size in zip(reversed(self.order), reversed(self.shape), strict=True):
            rank, coords[axis] = divmod(rank, size)
        return {axis: coords[axis] for axis in AXES}

    def rank_of(self, **coords: int) -> int:
        """The global rank at the given coordinates (missing axes count as 0)."""
        rank = 0
        for axis, size in zip(self.order, self.shape, strict=True):
            rank = rank * size + coords.get(axis, 0)
        return rank

    def _stride(self, axis: str) -> int:
        """How far apart in rank two neighbours on ``axis`` are (the product of the sizes after it in ``order``)."""
        return math.prod(self.shape[self.order.index(axis) + 1 :])

    def _group(self, axis: str) -> GroupInfo:
        stride = self._stride(axis)
        first = self.rank - self.coordinates[axis] * stride  # the member at coordinate 0 on `axis`
        members = tuple(range(first, first + self.degrees[axis] * stride, stride))
        return GroupInfo(size=self.degrees[axis], rank=self.coordinates[axis], world=members)

    @property
    def dp_info(self) -> GroupInfo:
        """The data-parallel group: replicas holding the same shard of the model."""
        return self._group("dp")

    @property
    def pp_info(self) -> GroupInfo:
        """The pipeline group: the stages of one model replica."""
        return self._group("pp")

    @property
    def sharding_info(self) -> GroupInfo:
        """The sharding group: ranks that split parameters and optimizer state (and see different data)."""
        return self._group("sharding")

    @property
    def mp_info(self) -> GroupInfo:
        """The tensor (model) parallel group."""
        return self._group("mp")

    @property
    def sep_info(self) -> GroupInfo:
        """The sequence-parallel group."""
        return self._group("sep")

    @property
    def data_info(self) -> GroupInfo:
        """Everyone that reads different data: rank ``dp_rank * sharding_size + sharding_rank``, for every order."""
        dp, sh = self.degrees["dp"], self.degrees["sharding"]
        dp_stride, sh_stride = self._stride("dp"), self._stride("sharding")
        first = self.rank - self.coordinates["dp"] * dp_stride - self.coordinates["sharding"] * sh_stride
        members = tuple(first + d * dp_stride + s * sh_stride for d in range(dp) for s in range(sh))
        rank = self.coordinates["dp"] * sh + self.coordinates["sharding"]
        return GroupInfo(size=dp * sh, rank=rank, world=members)

    @property
    def is_last(self) -> bool:
        """Whether this rank holds the last pipeline stage."""
        return self.coordinates["pp"] == self.degrees["pp"] - 1

    def __repr__(self) -> str:
        degrees = ", ".join(f"{axis}={self.degrees[axis]}" for axis in AXES)
        return f"Topology(rank={self.rank}, world_size={self.world_size}, {degrees}, order={','.join(self.order)})"

    def device_mesh(self, device_type: str = "cpu") -> torch.distributed.device_mesh.DeviceMesh:
        """A ``DeviceMesh`` of shape ``degrees in order`` with dimensions named by ``order``.

        Needs an initialised default process group of ``world_size`` ranks.
        """
        from torch.distributed.device_mesh import DeviceMesh

        mesh = torch.arange(self.world_size).reshape(self.shape)
        return DeviceMesh(device_type, mesh, mesh_dim_names=self.order)


def stream_seeds(seed: int, topology: Topology, distinct_data_parallel: bool = False) -> dict[str, int]:
    """The two seeds :func:`model_parallel_seed` uses on ``topology``'s rank.

    ``default``: identical across mp and sep peers (replicated activations), distinct across dp replicas, sharding
    ranks and pp stages. ``model-parallel-rng``: distinct across mp ranks and pp stages, identical across dp
    replicas, sharding ranks and sep peers (a tensor-parallel shard is initialised alike in every replica); with
    ``distinct_data_parallel`` distinct across dp replicas and sharding ranks too: training-time draws on a shard
    (dropout on a tensor-parallel activation), where each replica holds other samples, as one device would draw
    other numbers for them (the deterministic model-parallel strategy's rule: initialisation is under the base seed).

    Examples:
        >>> a, b = (stream_seeds(7, Topology(r, 2, mp_degree=2)) for r in (0, 1))
        >>> a["default"] == b["default"], a["model-parallel-rng"] == b["model-parallel-rng"]
        (True, False)
    """
    c = topology.coordinates
    shard = (c["pp"], c["mp"], c["dp"], c["sharding"]) if distinct_data_parallel else (c["pp"], c["mp"])
    return {
        "default": derive_seed(seed, "default", c["dp"], c["sharding"], c["pp"]),
        DEFAULT_STREAM: derive_seed(seed, DEFAULT_STREAM, *shard),
    }


def model_parallel_seed(
    seed: int, topology: Topology, tracker: RNGStatesTracker | None = None, distinct_data_parallel: bool = False
) -> dict[str, int]:
    """Seed this rank for model parallelism: the default generators and the tracker's ``"model-parallel-rng"``.

    Seeds come from :func:`stream_seeds` (hashed from stream names and coordinates, never ``seed + offset``).
    The default streams (python, numpy, torch on every device) get ``default``; the tracker's stream, replaced if
    present, gets ``model-parallel-rng``: use ``with tracker.fork():`` around dropout on tensor-parallel
    activations.

    Returns:
        The two seeds, by stream name.

    Examples:
        >>> seeds = model_parallel_seed(7, Topology(0, 1))
        >>> "model-parallel-rng" in get_rng_tracker()
        True
    """
    seed = check_seed(seed)
    tracker = tracker if tracker is not None else get_rng_tracker()
    seeds = stream_seeds(seed, topology, distinct_data_parallel)
    seed_all(seeds["default"])
    _record_seeds(seed, seeds["default"])
    if DEFAULT_STREAM in tracker:
        states = tracker.get_states()
        del states[DEFAULT_STREAM]
        tracker.set_states(states)
    tracker.add(DEFAULT_STREAM, seeds[DEFAULT_STREAM])
    return seeds


__all__ = ["AXES", "GroupInfo", "Topology", "model_parallel_seed", "stream_seeds"]
