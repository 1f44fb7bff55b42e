"""Tracker and topology on gloo ranks: tensor-parallel dropout, the device mesh, the strategy with a topology."""

import json
from types import MappingProxyType

import pytest
import torch
import torch.distributed as dist

from lightning_determinism import DeterministicDDPStrategy
from lightning_determinism.parallel.topology import Topology, model_parallel_seed
from lightning_determinism.seeding.rng import get_rng_tracker
from tests.helpers import run_distributed
from tests.helpers.lightning_models import fit, read_records

pytestmark = pytest.mark.distributed


def _dropout_masks(rank, world_size, out_dir):
    torch.manual_seed(100 + rank)  # perturbed: agreement must come from the seeding
    topo = Topology(rank, world_size, mp_degree=2)
    model_parallel_seed(5, topo)
    ones = torch.ones(64)
    outside = torch.nn.functional.dropout(ones, 0.5).tolist()
    with get_rng_tracker().fork():
        inside = torch.nn.functional.dropout(ones, 0.5).tolist()
    (out_dir / f"rank{rank}.json").write_text(json.dumps({"outside": outside, "inside": inside}))


def test_dropout_differs_inside_a_fork_and_matches_outside(tmp_path):
    run_distributed(_dropout_masks, tmp_path, tmp_path)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["outside"] == r1["outside"]  # replicated activations: same mask on both mp peers
    assert r0["inside"] != r1["inside"]  # tensor-parallel shards: their own masks


def _mesh(rank, world_size, out_dir):
    topo = Topology(rank, world_size, mp_degree=2, order=("pp", "dp", "sharding", "sep", "mp"))
    mesh = topo.device_mesh("cpu")
    record = {
        "names": list(mesh.mesh_dim_names),
        "shape": list(mesh.mesh.shape),
        "mp_group": sorted(dist.get_process_group_ranks(mesh.get_group("mp"))),
        "mp_world": list(topo.mp_info.world),
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(record))


def test_device_mesh_has_named_dimensions_matching_the_groups(tmp_path):
    run_distributed(_mesh, tmp_path, tmp_path)
    for rank in range(2):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["names"] == ["pp", "dp", "sharding", "sep", "mp"]
        assert record["shape"] == [1, 1, 1, 1, 2]
        assert record["mp_group"] == record["mp_world"] == [0, 1]


@pytest.mark.parametrize("given", ["dict", "DictConfig"])
def test_strategy_with_a_topology(tmp_path, given):
    topology = {"mp_degree": 2}
    if given == "DictConfig":  # Hydra's form of a config's mapping (lightning-hydra-template passes it on as it is)
        topology = pytest.importorskip("omegaconf").OmegaConf.create(topology)
    strategy = DeterministicDDPStrategy(seed=8, start_method="fork", topology=topology)
    fit(strategy, tmp_path)
    records = read_records(tmp_path, 2)
    assert records[0]["init_digest"] == records[1]["init_digest"]  # initialisation still from the base seed
    assert records[0]["local_seed"] == records[1]["local_seed"]  # mp peers share the default stream
    assert records[0]["draws"] == records[1]["draws"]
    assert records[0]["local_seed"] != 8


def test_topology_for_the_wrong_world_is_refused_early():
    with pytest.raises(ValueError, match="`mp_degree` must be a positive int"):
        DeterministicDDPStrategy(topology={"mp_degree": 0})
    with pytest.raises(TypeError, match="`topology` must be a Topology, a mapping of degrees or None, got list"):
        DeterministicDDPStrategy(topology=[2])
    # Any mapping is read as degrees, and checked as a dict is: a read-only one, a DictConfig (above)
    with pytest.raises(ValueError, match="`mp_degree` must be a positive int"):
        DeterministicDDPStrategy(topology=MappingProxyType({"mp_degree": 0}))
    order = ["pp", "dp", "sharding", "sep", "mp"]
    steps = DeterministicDDPStrategy(topology=MappingProxyType({"mp_degree": 2, "order": order}))._ldet_steps
    assert steps.topology_spec == {"mp_degree": 2, "order": tuple(order)}
