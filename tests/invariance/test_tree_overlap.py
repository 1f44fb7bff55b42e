"""The gradient tree's last micro-batch overlapped with its communication: bucket by bucket during the backward,
the same bits as without overlap (and as the one-process tree_sum reference)."""

import json

import pytest
import torch
from torch import nn

from lightning_determinism.invariance.tree import GradientTree, tree_sum
from tests.helpers import run_distributed

pytestmark = pytest.mark.distributed

LEAVES = 4  # micro-batches per process


def _model() -> nn.Module:
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return model


def _micro_batch(rank: int, leaf: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * rank + leaf))


def _step(model, tree, rank, overlap):
    """One optimizer step's local micro-batches; returns the flushed-during-backward count of the last one."""
    flushed_during_backward = 0
    for leaf in range(LEAVES):
        if overlap and leaf == LEAVES - 1:
            tree.arm()
        loss = model(_micro_batch(rank, leaf)).square().mean() / LEAVES
        loss.backward()
        if tree._hooks:
            flushed_during_backward = len(tree._exchanges)  # all_to_alls started during the backward
        tree.add_leaf()
    tree.finish(divide_by=2)
    return flushed_during_backward, torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _overlapped_equals_plain(rank, world_size, out_dir):
    results = {}
    for overlap in (False, True):
        model = _model()
        tree = GradientTree(list(model.parameters()), LEAVES, world_size, bucket_bytes=200)  # several buckets
        results[overlap] = _step(model, tree, rank, overlap)
    # Reference: every micro-batch gradient of both processes, summed by the one-process tree, halved.
    model = _model()
    leaves = []
    for r in range(world_size):
        for leaf in range(LEAVES):
            model.zero_grad()
            (model(_micro_batch(r, leaf)).square().mean() / LEAVES).backward()
            leaves.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone())
    reference = tree_sum(leaves) / world_size
    record = {
        "buckets": len(GradientTree(list(model.parameters()), LEAVES, world_size, bucket_bytes=200)._buckets),
        "flushed_during_backward": results[True][0],
        "overlapped_equals_plain": torch.equal(results[True][1], results[False][1]),
        "equals_reference": torch.equal(results[True][1], reference),
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(record))


def test_the_overlapped_last_leaf_gives_the_same_bits_bucket_by_bucket(tmp_path):
    run_distributed(_overlapped_equals_plain, tmp_path, tmp_path)
    for rank in range(2):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["buckets"] >= 3
        assert record["flushed_during_backward"] == record["buckets"]  # all started inside the backward
        assert record["overlapped_equals_plain"] and record["equals_reference"]
