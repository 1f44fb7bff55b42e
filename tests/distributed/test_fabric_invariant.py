"""World-size-invariant training in a LitGPT-style Fabric loop: the same bits on 1, 2 and 4 forked ranks, the errors.

A small model with dropout, Adam, B = 8 samples per step in M = 4 micro-batches of m = 2, 16 shuffled samples, 2
epochs (4 steps); each rank fingerprints the parameters after every step."""

import json

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_determinism import (
    DeterministicFabricDDPStrategy,
    DeterministicFabricSingleDeviceStrategy,
    fingerprint,
)
from tests.helpers import run_distributed

pytestmark = pytest.mark.distributed

INVARIANT = {"global_batch_size": 8, "micro_batch_size": 2}


def _data():
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(16, 6, generator=generator), torch.randn(16, 1, generator=generator))


def _loop(fabric, out=None, mark=True, accumulate_last=False, step_early=False):
    """The user's loop: returns rank 0's fingerprint of the parameters after every step."""
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.5), nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(_data(), batch_size=2, shuffle=True))
    invariant = getattr(fabric.strategy, "_ldet_invariant", None) is not None
    K = fabric.strategy.micro_batches_per_rank if invariant else 8 // (2 * fabric.world_size)
    prints = []
    for _ in range(2):
        for i, (x, y) in enumerate(loader):
            is_accumulating = (i + 1) % K != 0
            context = fabric.no_backward_sync(model, enabled=is_accumulating or accumulate_last)
            with context if mark else torch.enable_grad():
                loss = nn.functional.mse_loss(model(x), y)
                fabric.backward(loss / K)
            if not is_accumulating or step_early:
                optimizer.step()
                optimizer.zero_grad()
                prints.append(fingerprint(model))
    return prints


def _ddp_run(world_size, **kwargs):
    strategy = DeterministicFabricDDPStrategy(seed=5, start_method="fork", **kwargs)
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=world_size)
    return fabric.launch(_loop)


def _single_rank(rank, world_size, out):
    fabric = Fabric(strategy=DeterministicFabricSingleDeviceStrategy(seed=5, **INVARIANT), accelerator="cpu")
    out.write_text(json.dumps(fabric.launch(_loop)))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fabric-invariant")
    run_distributed(_single_rank, root, root / "single.json", world_size=1)  # a fork: the test's process untouched
    results = {w: _ddp_run(w, **INVARIANT) for w in (1, 2, 4)}
    results["single"] = json.loads((root / "single.json").read_text())
    results["plain"] = _ddp_run(2)  # the same loop without the invariant mode
    return results


def test_one_two_and_four_fabric_ranks_give_the_same_parameters_after_every_step(runs):
    assert len(runs[1]) == 4 and len(set(runs[1])) == 4
    assert runs["single"] == runs[1] == runs[2] == runs[4]


def test_without_the_invariant_mode_the_parameters_differ(runs):
    assert len(runs["plain"]) == 4
    assert runs["plain"][0] != runs[2][0]


def test_the_strategies_refuse_what_construction_can_refuse():
    with pytest.raises(ValueError, match="needs both `global_batch_size` and `micro_batch_size`"):
        DeterministicFabricDDPStrategy(global_batch_size=8)
    with pytest.raises(ValueError, match="must be a power of two"):
        DeterministicFabricSingleDeviceStrategy(global_batch_size=12, micro_batch_size=2)
    with pytest.raises(ValueError, match="debug_mode"):
        DeterministicFabricDDPStrategy(debug_mode=None, **INVARIANT)
    with pytest.raises(RuntimeError, match="call `fabric.launch\\(\\)` first"):
        _ = DeterministicFabricDDPStrategy(**INVARIANT).micro_batches_per_rank
    with pytest.raises(RuntimeError, match="pass `global_batch_size` and `micro_batch_size`"):
        _ = DeterministicFabricDDPStrategy().micro_batches_per_rank


@pytest.mark.parametrize(
    ("loop", "message"),
    [
        ({"mark": False}, r"`fabric.backward` ran without `fabric.no_backward_sync\(model, ...\)`"),
        ({"accumulate_last": True}, r"micro-batch 2 of K=2 of step 0 is marked accumulating \(enabled=True\)"),
        ({"step_early": True}, r"`optimizer.step\(\)` after 1 of the K=2 micro-batches of step 0"),
    ],
)
def test_a_loop_that_marks_its_micro_batches_otherwise_is_a_clear_error(loop, message):
    strategy = DeterministicFabricDDPStrategy(seed=5, start_method="fork", **INVARIANT)
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=2)
    with pytest.raises(Exception) as caught:  # noqa: PT011  (the rank's error travels back as the launcher's)
        fabric.launch(_loop, **loop)
    assert caught.match(message), str(caught.value)[-2000:]
