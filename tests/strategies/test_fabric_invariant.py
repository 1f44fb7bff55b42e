"""World-size-invariant training in a LitGPT-style Fabric loop: the same bits on 1, 2 and 4 forked ranks, the errors.

A small model with dropout, Adam, B = 8 samples per step in M = 4 micro-batches of m = 2, 16 shuffled samples, 2
epochs (4 steps); rank 0 keeps the parameters and Adam's state after every step. A loop saved with `fabric.save`
after epoch 1 and continued by a fresh Fabric after `fabric.load` is bitwise the straight one (the step count, from
which the micro-batch seeds derive, travels in FabricRNGState)."""

import copy
import io

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_determinism import (
    DeterminismWarning,
    DeterministicFabricDDPStrategy,
    DeterministicFabricSingleDeviceStrategy,
    DistributedMean,
    FabricRNGState,
    fingerprint,
)
from lightning_determinism.invariance.invariant import InvariantTraining
from lightning_determinism.strategies.fabric_invariant import FabricInvariantLoop
from tests.helpers import run_distributed

pytestmark = pytest.mark.distributed

INVARIANT = {"global_batch_size": 8, "micro_batch_size": 2}


def _data():
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(16, 6, generator=generator), torch.randn(16, 1, generator=generator))


def _snapshot(model, optimizer):
    return {"params": [p.detach().clone() for p in model.parameters()],
            "optimizer": copy.deepcopy(optimizer.state_dict()["state"])}  # fmt: skip


def _loop(fabric, mark=True, accumulate_last=False, step_early=False, save=None, resume=None):
    """The user's loop: rank 0's parameters and optimizer state after every step; ``save``: after epoch 1 only."""
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.5), nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(_data(), batch_size=2, shuffle=True))
    state = {"model": model, "optimizer": optimizer, "rng": FabricRNGState(loader), "epoch": 0}
    if resume is not None:
        torch.manual_seed(999)  # whatever happened in between
        fabric.load(resume, state)
    invariant = getattr(fabric.strategy, "_ldet_invariant", None) is not None
    K = fabric.strategy.micro_batches_per_rank if invariant else 8 // (2 * fabric.world_size)
    snapshots = []
    for _ in range(state["epoch"], 1 if save else 2):
        for i, (x, y) in enumerate(loader):
            is_accumulating = (i + 1) % K != 0
            context = fabric.no_backward_sync(model, enabled=is_accumulating or accumulate_last)
            with context if mark else torch.enable_grad():
                loss = nn.functional.mse_loss(model(x), y)
                fabric.backward(loss / K)
            if not is_accumulating or step_early:
                optimizer.step()
                optimizer.zero_grad()
                snapshots.append(_snapshot(model, optimizer))
        state["epoch"] += 1
    if save is not None:
        fabric.save(save, state)
    # Evaluation: 13 samples, one a batch; Fabric's sampler would pad them to 14 on 2 ranks, 16 on 4.
    val_loader = fabric.setup_dataloaders(DataLoader(TensorDataset(*(t[:13] for t in _data().tensors)), batch_size=1))
    val_loss = DistributedMean()
    model.eval()
    with torch.no_grad():
        for x, y in val_loader:
            val_loss.update((model(x) - y).pow(2).flatten())
    snapshots[-1]["val"] = val_loss.compute()
    buffer = io.BytesIO()  # tensors through the launcher's queue would outlive the rank's shared memory
    torch.save(snapshots, buffer)
    return buffer.getvalue()


def _unpacked(snapshots):
    return torch.load(io.BytesIO(snapshots))


def _ddp_run(world_size, **kwargs):
    loop = {key: kwargs.pop(key) for key in ("save", "resume") if key in kwargs}
    strategy = DeterministicFabricDDPStrategy(seed=5, start_method="fork", **kwargs)
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=world_size)
    return _unpacked(fabric.launch(_loop, **loop))


def _single_fabric():
    return Fabric(strategy=DeterministicFabricSingleDeviceStrategy(seed=5, **INVARIANT), accelerator="cpu")


def _single_rank(rank, world_size, out):
    """One device: the straight loop, then the loop saved after epoch 1 and continued by a fresh Fabric."""
    straight = _unpacked(_single_fabric().launch(_loop))
    first = _unpacked(_single_fabric().launch(_loop, save=out / "single.ckpt"))
    resumed = first + _unpacked(_single_fabric().launch(_loop, resume=out / "single.ckpt"))
    torch.save({"single": straight, "single-resumed": resumed}, out / "single.pt")


def _prints(run):
    return [fingerprint(snapshot) for snapshot in run]


def _tensors(snapshot):
    yield from snapshot["params"]
    for index in sorted(snapshot["optimizer"]):
        for key in sorted(snapshot["optimizer"][index]):
            yield snapshot["optimizer"][index][key]


def _equal_steps(run, other):
    """Per step: whether every parameter and optimizer-state tensor is bitwise the other run's."""
    return [
        all(torch.equal(a, b) for a, b in zip(_tensors(one), _tensors(two), strict=True))
        for one, two in zip(run, other, strict=True)
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fabric-invariant")
    run_distributed(_single_rank, root, root, world_size=1)  # a fork: the test's process untouched
    results = {w: _ddp_run(w, **INVARIANT) for w in (1, 2, 4)}
    results.update(torch.load(root / "single.pt"))
    results["plain"] = _ddp_run(2)  # the same loop without the invariant mode
    first = _ddp_run(2, save=root / "ddp.ckpt", **INVARIANT)
    results["2-resumed"] = first + _ddp_run(2, resume=root / "ddp.ckpt", **INVARIANT)
    return results


def test_one_two_and_four_fabric_ranks_give_the_same_parameters_after_every_step(runs):
    assert len(runs[1]) == 4 and len(set(_prints(runs[1]))) == 4
    assert _prints(runs["single"]) == _prints(runs[1]) == _prints(runs[2]) == _prints(runs[4])


def test_evaluation_counts_every_sample_once_on_one_two_and_four_ranks(runs):
    values = [runs[w][-1]["val"] for w in (1, 2, 4)]  # after the last step; Fabric's sampler padded 2 and 4 ranks
    assert values[0] == values[1] == values[2] and runs["single"][-1]["val"] == values[0]
    assert values[0].dtype == torch.float64 and values[0].item() > 0


def test_without_the_invariant_mode_the_parameters_differ(runs):
    assert len(runs["plain"]) == 4
    assert _prints(runs["plain"])[0] != _prints(runs[2])[0]


@pytest.mark.parametrize("run", ["single", 2])
def test_a_loop_resumed_from_fabric_save_is_bitwise_the_straight_one_after_every_step(runs, run):
    resumed = runs["single-resumed" if run == "single" else "2-resumed"]
    assert _equal_steps(resumed, runs[run]) == [True] * 4  # parameters and Adam's state; steps 3, 4 after the load


def _bound_state(step=0, **sizes):
    """A FabricRNGState bound to an invariant loop that took ``step`` steps, as the strategy binds it."""
    state = FabricRNGState()
    state.invariant = FabricInvariantLoop(InvariantTraining(**{**INVARIANT, **sizes}), marks_micro_batches=False)
    state.invariant.step = step
    return state


def test_the_step_count_travels_in_the_state_and_the_batch_sizes_must_match():
    saved = _bound_state(step=3).state_dict()
    assert saved["invariant"] == {"global_batch_size": 8, "micro_batch_size": 2, "step": 3}
    state = _bound_state()
    state.load_state_dict(saved)
    assert state.invariant.step == 3
    for name, value in (("global_batch_size", 16), ("micro_batch_size", 4)):
        other = _bound_state(step=3, **{name: value}).state_dict()
        with pytest.raises(ValueError, match=rf"`{name}` must be the checkpoint's .* expected {value} \(saved\), got"):
            _bound_state().load_state_dict(other)


def test_the_state_carries_the_runs_identity(tmp_path):
    torch.save({"rng": _bound_state(step=3).state_dict(), "plain": FabricRNGState().state_dict()}, tmp_path / "s.pt")
    saved = torch.load(tmp_path / "s.pt", weights_only=True)
    identity = {key: value for key, value in saved["rng"]["identity"].items() if key != "base_seed"}
    assert identity == {"world_size": 1, "global_batch_size": 8, "micro_batch_size": 2, "micro_batches_per_rank": 4}
    assert saved["plain"]["identity"]["global_batch_size"] is None


def test_an_invariant_checkpoint_loaded_without_the_invariant_mode_warns():
    with pytest.warns(DeterminismWarning, match=r"saved in the world-size-invariant mode \(global_batch_size=8"):
        FabricRNGState().load_state_dict(_bound_state(step=3).state_dict())


def test_a_checkpoint_without_the_step_count_warns_before_the_first_step_and_is_refused_after():
    old = FabricRNGState().state_dict()
    del old["invariant"]  # as an older lightning-determinism wrote it
    state = _bound_state()
    with pytest.warns(DeterminismWarning, match="micro-batch seeds restart at step 0"):
        state.load_state_dict(old)
    assert state.invariant.step == 0
    with pytest.raises(RuntimeError, match=r"holds no step count .* already took 2 step\(s\)"):
        _bound_state(step=2).load_state_dict(old)


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
    # Per-worker seeds follow the rank that loads a sample: per-sample seeds are the invariant mode's default.
    with pytest.raises(ValueError, match=r"needs `per_sample=True` \(the default there\), got `per_sample=False`"):
        DeterministicFabricDDPStrategy(per_sample=False, **INVARIANT)
    assert DeterministicFabricDDPStrategy(**INVARIANT).per_sample
    assert not DeterministicFabricDDPStrategy().per_sample
    assert not DeterministicFabricDDPStrategy(per_sample=False, seed_workers=False, **INVARIANT).per_sample


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
