"""Sharding-invariant digests on gloo ranks: one parameter's digest is the one-process digest under FSDP2, tensor
parallel and both, for Shard(0), Shard(1) and uneven shards, and no full parameter is ever gathered."""

import pytest
import torch
from torch import nn

from lightning_determinism._compat.features import UNEVEN_STRIDED
from lightning_determinism.divergence.tensor_digest import digests, full_norms
from tests.helpers import requires_feature, run_distributed

pytestmark = pytest.mark.distributed
# torch < 2.10 gathers uneven FSDP2 x tensor-parallel shards wrongly (its bug): the 2 x 2 layout needs 2.10
NEEDS_EVEN_GATHER_FIX = requires_feature(UNEVEN_STRIDED)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down, self.norm = nn.Linear(6, 10), nn.Linear(10, 6), nn.LayerNorm(6)


def _one_process():
    torch.manual_seed(9)
    block = _Block()
    named = dict(block.named_parameters())
    norms = {f"norm:{name}": float(p.detach().double().norm()) for name, p in named.items()}
    return dict(zip(named, digests(list(named.values())), strict=True)), norms


def _sharded(rank, world_size, out_dir, tp):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    def refuse(*args, **kwargs):
        raise AssertionError("a full tensor was gathered")

    mesh = init_device_mesh("cpu", (world_size // tp, tp), mesh_dim_names=("data_parallel", "tensor_parallel"))
    torch.manual_seed(9)
    block = _Block()
    if tp > 1:
        parallelize_module(block, mesh["tensor_parallel"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if world_size // tp > 1:
        fully_shard(block, mesh=mesh["data_parallel"])
    DTensor.full_tensor = refuse  # the forked rank's copy of the class
    DTensor.redistribute = refuse
    named = dict(block.named_parameters())
    record = dict(zip(named, digests(list(named.values())), strict=True))
    record.update({f"norm:{name}": norm for name, norm in zip(named, full_norms(list(named.values())), strict=True)})
    flat = init_device_mesh("cpu", (world_size,))
    odd = torch.arange(7 * 5, dtype=torch.float32).reshape(7, 5)  # uneven on 2 and 4 ranks, both dimensions
    record["odd"] = digests([distribute_tensor(odd, flat, [Shard(d)], src_data_rank=None) for d in (0, 1)])
    torch.save(record, out_dir / f"rank{rank}.pt")


@pytest.mark.parametrize(("world_size", "tp"), [(2, 1), (2, 2), pytest.param(4, 2, marks=NEEDS_EVEN_GATHER_FIX)])
def test_one_parameters_digest_is_the_one_process_digest_whatever_the_sharding(tmp_path, world_size, tp):
    run_distributed(_sharded, tmp_path, tmp_path, tp, world_size=world_size)
    reference, norms = _one_process()
    odd = digests([torch.arange(7 * 5, dtype=torch.float32).reshape(7, 5)])[0]
    for rank in range(world_size):
        record = torch.load(tmp_path / f"rank{rank}.pt")
        assert record.pop("odd") == [odd, odd]
        for name, norm in norms.items():  # float64 partial sums added in another order: equal to 1e-15 relative
            assert record.pop(name) == pytest.approx(norm, rel=1e-15, abs=0)
        assert record == reference


def _async_collective(rank, world_size, out_dir):
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as funcol

    from lightning_determinism import fingerprint
    from lightning_determinism.divergence.tensor_digest import digest_of

    x = torch.arange(24, dtype=torch.float32).reshape(4, 6) * (rank + 1)
    reduced = funcol.all_reduce(x, "sum", dist.group.WORLD)  # what a RowwiseParallel module returns, not waited on
    assert type(reduced).__name__ == "AsyncCollectiveTensor"
    record = {
        "digest": digest_of(reduced),
        "fingerprint": fingerprint({"t": funcol.all_reduce(x, "sum", dist.group.WORLD)}),
    }
    torch.save(record, out_dir / f"rank{rank}.pt")


def test_an_async_collective_tensor_is_digested_after_its_collective_never_a_crash(tmp_path):
    from lightning_determinism import fingerprint
    from lightning_determinism.divergence.tensor_digest import reference_digest

    run_distributed(_async_collective, tmp_path, tmp_path)
    want = torch.arange(24, dtype=torch.float32).reshape(4, 6) * 3  # rank 0's x + rank 1's x
    for rank in range(2):
        record = torch.load(tmp_path / f"rank{rank}.pt")
        assert record["digest"] == reference_digest(want)
        assert record["fingerprint"] == fingerprint({"t": want})
