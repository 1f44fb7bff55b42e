"""DTensor random ops under lightning_determinism.parallel.dtensor_random: each shard draws its slice of the
one-device draw (any degree, any shard dimension), replicas draw alike, the meta-device path initialises exactly."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_determinism._compat.features import UNEVEN_STRIDED
from lightning_determinism.parallel import dtensor_random
from tests.helpers import requires_cuda, requires_feature, run_distributed

pytestmark = pytest.mark.distributed
# torch < 2.10 gathers uneven FSDP2 x tensor-parallel shards wrongly (its bug): the 2 x 2 layout needs 2.10
NEEDS_EVEN_GATHER_FIX = requires_feature(UNEVEN_STRIDED)

SHAPE = (6, 10)  # uneven on 4 ranks along both dimensions


def _one_device(seed):
    """What one process draws, in order, from one seed: the reference."""
    torch.manual_seed(seed)
    ones = torch.ones(SHAPE)
    drawn = [F.dropout(ones, 0.5), torch.empty(SHAPE).uniform_(-1, 1), torch.randn_like(ones)]
    drawn += [draw(torch.empty(SHAPE)) for draw in IN_PLACE_DRAWS]
    return [*drawn, torch.rand(3)]


IN_PLACE_DRAWS = (  # the in-place samplers DTensor does not count as random ops: routed too, never stock
    lambda t: t.exponential_(2.0),
    lambda t: t.log_normal_(0.5, 1.5),
    lambda t: t.geometric_(0.3),
    lambda t: t.cauchy_(),
    lambda t: t.random_(0, 100),
    lambda t: t.random_(50),
    lambda t: t.random_(),
)


def _draws(rank, world_size, out_dir, exact):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    if exact:
        dtensor_random.install(mesh)
    record = {}
    for name, placement in (("shard0", Shard(0)), ("shard1", Shard(1)), ("replicate", Replicate())):
        torch.manual_seed(11)  # one stream on every peer, as the mesh rule gives tensor-parallel peers
        ones = distribute_tensor(torch.ones(SHAPE), mesh, [placement], src_data_rank=None)
        drawn = [F.dropout(ones, 0.5), distribute_tensor(torch.empty(SHAPE), mesh, [placement]).uniform_(-1, 1),
                 torch.randn_like(ones)]  # fmt: skip
        if exact:  # stock: some have no sharding rule at all (random_), the others draw the first slice's numbers
            drawn += [draw(distribute_tensor(torch.empty(SHAPE), mesh, [placement])) for draw in IN_PLACE_DRAWS]
        record[name] = [t.full_tensor() for t in drawn] + [torch.rand(3)]  # the stream afterwards, too
    dtensor_random.uninstall()
    torch.save(record, out_dir / f"rank{rank}.pt")


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_placement_draws_the_one_device_numbers(tmp_path, world_size):
    run_distributed(_draws, tmp_path, tmp_path, True, world_size=world_size)
    reference = _one_device(11)
    for rank in range(world_size):
        record = torch.load(tmp_path / f"rank{rank}.pt")
        for name, drawn in record.items():
            for got, want in zip(drawn, reference, strict=True):
                assert torch.equal(got, want), (rank, name)


def test_stock_shards_do_not(tmp_path):
    """Without the routing the shards draw their own (equal) numbers: the reference the routing fixes."""
    run_distributed(_draws, tmp_path, tmp_path, False)
    record, reference = torch.load(tmp_path / "rank0.pt"), _one_device(11)
    assert not torch.equal(record["shard1"][0], reference[0])
    assert torch.equal(record["replicate"][0], reference[0])


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(6, 10), nn.Linear(10, 6)


def _meta_init(rank, world_size, out_dir, tp):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world_size // tp, tp), mesh_dim_names=("data_parallel", "tensor_parallel"))
    dtensor_random.install(mesh)
    torch.manual_seed(5)  # configure_model's base seed: the meta-device build draws nothing
    with torch.device("meta"):
        block = _Block()
    if tp > 1:
        parallelize_module(block, mesh["tensor_parallel"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if world_size // tp > 1:
        fully_shard(block, mesh=mesh["data_parallel"])
    block.to_empty(device="cpu")
    for module in (block.up, block.down):  # the order in which one process builds them
        module.reset_parameters()
    state = {name: p.full_tensor() for name, p in block.named_parameters()}
    dtensor_random.uninstall()
    torch.save(state, out_dir / f"rank{rank}.pt")


@pytest.mark.parametrize(("world_size", "tp"), [(2, 2), (2, 1), pytest.param(4, 2, marks=NEEDS_EVEN_GATHER_FIX)])
def test_meta_device_initialisation_is_the_one_process_model(tmp_path, world_size, tp):
    run_distributed(_meta_init, tmp_path, tmp_path, tp, world_size=world_size)
    torch.manual_seed(5)
    reference = _Block().state_dict()
    for rank in range(world_size):
        state = torch.load(tmp_path / f"rank{rank}.pt")
        assert state.keys() == reference.keys()
        for name, value in state.items():
            assert torch.equal(value, reference[name]), (rank, name)


def test_uninstall_puts_back_dtensors_own_handling():
    from lightning_determinism._compat.access import dtensor_op_handlers

    before = dict(dtensor_op_handlers())
    routed = dtensor_random.install()
    assert dtensor_random.installed() and set(routed) == set(dtensor_random.HANDLED)
    assert dtensor_random.install() == routed  # again: idempotent
    dtensor_random.uninstall()
    assert not dtensor_random.installed() and dtensor_op_handlers() == before


def test_routing_on_a_cpu_mesh_warns_nothing(tmp_path):
    # torch's "DTensor random operators may not have complete support on cpu device mesh" came from asking torch
    # about a CPU mesh in the package (and was attributed to _compat/access.py): the routed ops are complete there.
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            dtensor_random.install(mesh)
        assert [str(w.message) for w in seen] == []
    finally:
        dtensor_random.uninstall()
        dist.destroy_process_group()


@requires_cuda  # DTensor's RNG tracker exists on CUDA meshes only
def test_cuda_tracker_keeps_each_rank_seed(tmp_path):
    import torch.distributed as dist
    import torch.distributed.tensor._random as stock
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,))
        dtensor_random.install(mesh)
        assert stock._rng_tracker is not None  # created without the rank-0 broadcast
        torch.cuda.manual_seed(3)
        ones = distribute_tensor(torch.ones(SHAPE, device="cuda"), mesh, [Shard(1)])
        got = F.dropout(ones, 0.5).full_tensor()
        torch.cuda.manual_seed(3)
        assert torch.equal(got, F.dropout(torch.ones(SHAPE, device="cuda"), 0.5))
    finally:
        dtensor_random.uninstall()
        stock._rng_tracker = None
        dist.destroy_process_group()


def _uneven(rank, world_size, out_dir):
    import json

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from lightning_determinism.errors import IncompatibleVersionError
    from lightning_determinism.parallel import fsdp2_versions

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    block = _Block()  # up: 10 rows, column-parallel then FSDP2 on the same dimension: 10 over 2 x 2
    parallelize_module(block, mesh["tensor_parallel"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(block, mesh=mesh["data_parallel"])
    said = {"found": fsdp2_versions.uneven_strided_shards(block)}
    for release in ((2, 9), (2, 10)):
        fsdp2_versions.TORCH_RELEASE = release
        try:
            fsdp2_versions.refuse_uneven_strided_shards(block)
            said[str(release)] = None
        except IncompatibleVersionError as error:
            said[str(release)] = str(error)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(said))


def test_uneven_fsdp2_by_tensor_parallel_shards_are_refused_in_one_line_below_torch_2_10(tmp_path):
    import json

    from lightning_determinism._compat.features import FEATURES, UNEVEN_STRIDED

    run_distributed(_uneven, tmp_path, tmp_path, world_size=4)
    for rank in range(4):
        said = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert said["found"] == [
            "up.weight: dimension 0 of 10 over 4 shards",
            "up.bias: dimension 0 of 10 over 4 shards",
        ]
        assert said["(2, 10)"] is None  # torch 2.10 gathers them right: nothing to refuse
        refusal = said["(2, 9)"]  # torch 2.9 (as the module is told): refused, in one line
        assert refusal is not None and "\n" not in refusal and UNEVEN_STRIDED in refusal
        assert (
            "up.weight: dimension 0 of 10 over 4 shards (and 1 more)" in refusal and FEATURES[UNEVEN_STRIDED] in refusal
        )
