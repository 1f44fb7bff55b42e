"""Topology against a brute-force enumeration, and the seed-stream rules over every small topology."""

import itertools
import math
from collections import defaultdict

import numpy as np
import pytest

from lightning_determinism.parallel.topology import AXES, GroupInfo, Topology, stream_seeds


def degree_tuples(max_world):
    """Every (dp, pp, sharding, mp, sep) with a product <= max_world."""
    out = []

    def rec(prefix, budget):
        if len(prefix) == 5:
            out.append(tuple(prefix))
            return
        for d in range(1, budget + 1):
            rec([*prefix, d], budget // d)

    rec([], max_world)
    return out


def brute(degrees, order, ranks):
    """The coordinates and groups of ``ranks``, by enumerating the mesh (last axis of `order` fastest): a group along
    an axis is a row of the mesh with that axis moved last; the data group, with dp then sharding moved last."""
    shape = [degrees[a] for a in order]
    mesh = np.arange(math.prod(shape)).reshape(shape)
    coords = {rank: dict(zip(order, map(int, np.unravel_index(rank, shape)), strict=True)) for rank in ranks}
    groups = {rank: {} for rank in ranks}
    for axis in (*AXES, "data"):
        moved = [order.index(a) for a in (("dp", "sharding") if axis == "data" else (axis,))]
        last = list(range(len(order) - len(moved), len(order)))
        for row in np.moveaxis(mesh, moved, last).reshape(-1, math.prod(shape[i] for i in moved)).tolist():
            for rank in set(row) & groups.keys():
                groups[rank][axis] = tuple(row)
    return coords, groups


def check_against_brute(degrees, order, ranks=None):
    world = math.prod(degrees.values())
    coords, groups = brute(degrees, order, range(world) if ranks is None else ranks)
    for rank in coords:
        topo = Topology(rank, world, *(degrees[a] for a in ("dp", "pp", "sharding", "mp", "sep")), order=order)
        assert topo.coordinates == coords[rank]
        for axis in AXES:
            info = getattr(topo, f"{axis}_info")
            assert info == GroupInfo(degrees[axis], coords[rank][axis], groups[rank][axis])
        data_rank = coords[rank]["dp"] * degrees["sharding"] + coords[rank]["sharding"]
        assert topo.data_info == GroupInfo(degrees["dp"] * degrees["sharding"], data_rank, groups[rank]["data"])
        assert topo.is_last == (coords[rank]["pp"] == degrees["pp"] - 1)


ORDERS = list(itertools.permutations(AXES))


def test_matches_brute_force_for_every_rank_up_to_8_and_all_orders():
    for dp, pp, sh, mp, sep in degree_tuples(8):
        degrees = {"dp": dp, "pp": pp, "sharding": sh, "mp": mp, "sep": sep}
        for order in ORDERS:
            check_against_brute(degrees, order)


def test_matches_brute_force_up_to_64_over_rotating_orders_and_ranks():
    # Every topology with 8 < world <= 64, each with 4 of the 120 orders and 3 ranks, rotating through both so
    # that every order and every rank position is exercised (an exhaustive run takes minutes).
    for i, (dp, pp, sh, mp, sep) in enumerate(degree_tuples(64)):
        degrees = {"dp": dp, "pp": pp, "sharding": sh, "mp": mp, "sep": sep}
        world = math.prod(degrees.values())
        if world <= 8:
            continue
        for j in range(4):
            check_against_brute(degrees, ORDERS[(4 * i + j) % len(ORDERS)], {0, world - 1, (7 * i + j) % world})


def test_data_rank_is_right_when_sharding_comes_first():
    # PaddleNLP's helper computes data ranks from the axis order and gets this case wrong.
    order = ("sharding", "dp", "pp", "mp", "sep")
    seen = set()
    for rank in range(8):
        topo = Topology(rank, 8, dp_degree=2, sharding_degree=2, mp_degree=2, order=order)
        c = topo.coordinates
        assert topo.data_info.rank == c["dp"] * 2 + c["sharding"]
        seen.add((topo.data_info.rank, c["mp"]))
    assert len(seen) == 8


def test_stream_rules_hold_for_every_topology_up_to_64(monkeypatch):
    # The seeds depend on coordinates only (checked against brute force above for every order), so the axis order
    # cannot change these rules. derive_seed is memoised here: the same function, called fewer times.
    import functools

    import lightning_determinism.parallel.topology as topology_module

    monkeypatch.setattr(topology_module, "derive_seed", functools.lru_cache(maxsize=None)(topology_module.derive_seed))
    for dp, pp, sh, mp, sep in degree_tuples(64):
        world = dp * pp * sh * mp * sep
        topo = Topology(0, world, dp, pp, sh, mp, sep)
        by_default = defaultdict(set)
        by_mp_stream = defaultdict(set)
        for rank in range(world):
            c = topo.coordinates_of(rank)
            seeds = stream_seeds(11, _at(topo, rank))
            by_default[seeds["default"]].add((c["dp"], c["sharding"], c["pp"]))
            by_mp_stream[seeds["model-parallel-rng"]].add((c["pp"], c["mp"]))
        # equal where they must be equal, and never equal where they must differ:
        assert all(len(keys) == 1 for keys in by_default.values())
        assert len(by_default) == dp * sh * pp
        assert all(len(keys) == 1 for keys in by_mp_stream.values())
        assert len(by_mp_stream) == pp * mp
        assert not set(by_default) & set(by_mp_stream)  # the two kinds of stream never share a seed


def _at(topo, rank):
    """A light copy of `topo` moved to `rank` (the stream seeds only read coordinates)."""
    moved = object.__new__(Topology)
    moved.__dict__.update(topo.__dict__)
    moved.rank = rank
    moved.coordinates = topo.coordinates_of(rank)
    return moved


def test_dp_degree_is_inferred():
    assert Topology(0, 12, pp_degree=2, mp_degree=3).degrees["dp"] == 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"device_rank": 0, "world_size": 6, "mp_degree": 4},
            r"cannot infer `dp_degree`: world_size=6 is not divisible",
        ),
        ({"device_rank": 0, "world_size": 8, "dp_degree": 2, "mp_degree": 2}, r"multiply to world_size=8, got dp=2"),
        ({"device_rank": 8, "world_size": 8}, r"`device_rank` must be in \[0, 8\) for world_size=8, got 8"),
        ({"device_rank": -1, "world_size": 8}, r"`device_rank` must be in \[0, 8\)"),
        ({"device_rank": 0, "world_size": 2, "mp_degree": 0}, r"`mp_degree` must be a positive int, got 0"),
        ({"device_rank": 0, "world_size": 2, "order": ("dp", "pp", "mp", "sep")}, r"`order` must be a permutation"),
        (
            {"device_rank": 0, "world_size": 2, "order": ("dp", "dp", "pp", "mp", "sep")},
            r"`order` must be a permutation",
        ),
    ],
)
def test_bad_input_says_what_and_why(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Topology(**kwargs)


def test_repr_and_last_stage():
    topo = Topology(6, 8, pp_degree=2, mp_degree=2)
    assert (
        repr(topo) == "Topology(rank=6, world_size=8, dp=2, pp=2, sharding=1, mp=2, sep=1, order=dp,pp,sharding,mp,sep)"
    )
    assert topo.is_last and not Topology(0, 8, pp_degree=2, mp_degree=2).is_last
