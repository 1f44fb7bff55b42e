"""The chunked exchange: every rank gets, bit for bit, what one process adding all ``W`` terms in the fixed order gets
(the balanced tree for a power-of-two ``W``, rank order otherwise), for sizes ``W`` does not divide too; and the DDP
hook built on it (PairwiseAllReduce) gives 0.1.0's sums: the tree of two-process all-reduces, or the gathered terms
added in rank order."""

import json

import pytest
import torch
import torch.distributed as dist

from lightning_determinism.invariance.exchange import ChunkExchange, add_rows_in_order, add_rows_in_tree, padded_numel
from lightning_determinism.invariance.tree import PairwiseAllReduce, tree_sum
from tests.helpers import run_distributed

NUMEL = 1001  # no world size here divides it


def _term(rank: int) -> torch.Tensor:
    # Terms of mixed magnitudes: float32 sums in another order differ in their last bits
    gen = torch.Generator().manual_seed(10 + rank)
    return torch.randn(NUMEL, generator=gen) * torch.logspace(-6, 6, NUMEL)


def _sequential(terms: list[torch.Tensor]) -> torch.Tensor:
    total = terms[0].clone()
    for term in terms[1:]:
        total = total + term
    return total


class _Bucket:
    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def buffer(self) -> torch.Tensor:
        return self._tensor


def _exchange_rank(rank, world_size, out_dir):
    power_of_two = world_size & (world_size - 1) == 0
    flat = torch.zeros(padded_numel(NUMEL, world_size))
    flat[:NUMEL] = _term(rank)
    exchange = ChunkExchange(flat, world_size, tree=power_of_two)
    exchange.reduce(divide_by=1)
    summed = exchange.wait()[:NUMEL]
    bucket = _Bucket(_term(rank).clone())
    hooked = PairwiseAllReduce(world_size, rank).reduce(None, bucket).value()
    terms = [_term(r) for r in range(world_size)]
    reference = tree_sum(terms) if power_of_two else _sequential(terms)
    hook_reference = [t / world_size for t in terms]
    hook_reference = tree_sum(hook_reference) if power_of_two else _sequential(hook_reference)
    record = {
        "exchange": torch.equal(summed, reference),
        "hook": torch.equal(hooked, hook_reference),
        "other_order_differs": not torch.equal(_sequential(terms[::-1]), reference),
    }
    dist.barrier()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(record))


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_rank_gets_the_fixed_order_sum_bit_for_bit(tmp_path, world_size):
    run_distributed(_exchange_rank, tmp_path, tmp_path, world_size=world_size)
    for rank in range(world_size):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        if world_size > 2:  # two terms: a + b = b + a
            assert record["other_order_differs"]  # the check can fail: the order shows in the bits
        assert record["exchange"] and record["hook"], record


def test_rows_add_in_the_tree_and_in_rank_order():
    rows = torch.tensor([[1e8], [1.0], [-1e8], [1.0]])
    # float32's spacing at 1e8 is 8: 1e8 + 1 rounds to 1e8
    assert add_rows_in_tree(rows.clone()).item() == 0.0  # (1e8 + 1) + (-1e8 + 1) = 1e8 - 1e8
    assert add_rows_in_order(rows.clone()).item() == 1.0  # ((1e8 + 1) - 1e8) + 1 = 0 + 1
    assert torch.equal(add_rows_in_tree(rows.clone()), tree_sum(list(rows)))


def test_a_flat_tensor_that_the_world_size_does_not_divide_is_refused():
    with pytest.raises(ValueError, match=r"`flat` must hold a multiple of world_size=4 elements, got 10"):
        ChunkExchange(torch.zeros(10), world_size=4)


def _gather_without_the_flat_form(rank, world_size, out_dir):
    def refuse(*args, **kwargs):
        raise RuntimeError("ProcessGroupGloo does not support _allgather_base")  # older torch releases' gloo

    dist.all_gather_single = dist.all_gather_into_tensor = refuse  # in this forked rank only
    from lightning_determinism.invariance.exchange import all_gather_flat

    out = torch.zeros(3 * world_size)
    all_gather_flat(out, torch.full((3,), float(rank + 1)), async_op=True).wait()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(out.tolist()))


@pytest.mark.distributed
def test_a_backend_without_the_flat_all_gather_gathers_into_views(tmp_path):
    run_distributed(_gather_without_the_flat_form, tmp_path, tmp_path)
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == [1.0, 1.0, 1.0, 2.0, 2.0, 2.0]
