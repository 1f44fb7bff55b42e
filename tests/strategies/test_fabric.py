"""Lightning Fabric in one process: the registered strategies, worker streams equal to the Trainer path's, a late
seed_everything, FabricRNGState through fabric.save/load (bitwise resume, policies, errors), the baseline recorder."""

import json

import lightning as L
import pytest
import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY
from torch import nn
from torch.utils.data import DataLoader

from lightning_determinism import (
    BaselineMismatch,
    BaselineRecorder,
    DeterminismWarning,
    DeterministicFabricDDPStrategy,
    DeterministicFabricSingleDeviceStrategy,
    DeterministicSingleDeviceStrategy,
    FabricRNGState,
    WorkerSeedCallback,
)
from lightning_determinism.seeding.seeds import current_seeds
from tests.helpers.lightning_models import NoisyPoints, StreamDataset, _uncollated, fit_streams

KEYS = ("epoch", "index", "worker", "pytorch_worker_seed", "torch", "numpy", "python")


def _fabric(seed=7, per_sample=False, **kwargs):
    strategy = DeterministicFabricSingleDeviceStrategy(seed=seed, device="cpu", per_sample=per_sample, **kwargs)
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    return fabric


def _fabric_streams(per_sample, persistent):
    fabric = _fabric(per_sample=per_sample)
    fabric.seed_everything(7)  # workers=True: Fabric adds Lightning's worker_init_fn, which ours must replace
    fabric.setup(nn.Linear(1, 1))
    loader = fabric.setup_dataloaders(
        DataLoader(
            StreamDataset(16),
            batch_size=2,
            shuffle=True,
            num_workers=2,
            collate_fn=_uncollated,
            persistent_workers=persistent,
        )  # fmt: skip
    )
    samples = []
    for epoch in range(2):
        for batch in loader:
            samples.extend({**sample, "epoch": epoch} for sample in batch)
    return samples


@pytest.mark.parametrize(("per_sample", "persistent"), [(False, False), (True, True)])
def test_worker_streams_are_the_trainer_paths(tmp_path, per_sample, persistent):
    trainer_samples, _ = fit_streams(
        DeterministicSingleDeviceStrategy(seed=7, device="cpu"), tmp_path, [WorkerSeedCallback(per_sample=per_sample)],
        devices=1, epochs=2, persistent_workers=persistent,
    )  # fmt: skip
    fabric_samples = _fabric_streams(per_sample, persistent)
    assert [[s[k] for k in KEYS] for s in fabric_samples] == [[s[k] for k in KEYS] for s in trainer_samples]
    draws = [s["torch"] for s in fabric_samples]
    assert len({json.dumps(d) for d in draws}) == len(draws) == 32  # every sample its own draw, epochs differ


def test_the_registered_names_build_the_deterministic_classes():
    for name, cls in (("ddp_deterministic", DeterministicFabricDDPStrategy),
                      ("ddp_spawn_deterministic", DeterministicFabricDDPStrategy),
                      ("single_device_deterministic", DeterministicFabricSingleDeviceStrategy)):  # fmt: skip
        assert STRATEGY_REGISTRY[name]["strategy"] is cls
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="single_device_deterministic")
    assert isinstance(fabric.strategy, DeterministicFabricSingleDeviceStrategy)
    assert STRATEGY_REGISTRY["ddp_spawn_deterministic"]["init_params"] == {"start_method": "spawn"}


def test_a_seed_everything_after_launch_becomes_the_base_seed(monkeypatch):
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    fabric = _fabric(seed=None)
    drawn = fabric.strategy.base_seed
    fabric.seed_everything(drawn + 1 if drawn < 2**31 else 5)  # Fabric's usual order: launch(), then seed
    wanted = int(torch.initial_seed())
    with fabric.init_module():
        net = nn.Linear(4, 4)
    expected = (torch.manual_seed(wanted), nn.Linear(4, 4))[1]  # independent: seeded by hand, built the same way
    assert torch.equal(net.weight, expected.weight)
    fabric.setup(net)
    assert fabric.strategy.base_seed == wanted and current_seeds() == {"base_seed": wanted, "local_seed": wanted}
    assert torch.equal(torch.rand(3), (torch.manual_seed(wanted), torch.rand(3))[1])  # rank 0: base + 0


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError, match="`per_sample` must be a bool, got 'yes'"):
        DeterministicFabricSingleDeviceStrategy(device="cpu", per_sample="yes")
    with pytest.raises(ValueError, match="`seed`"):
        DeterministicFabricDDPStrategy(seed=-1)


def _train(fabric, epochs, path=None, resume=None, with_rng=True):
    """Dropout, a shuffled loader whose samples are augmented in 2 workers; saves after ``epochs`` if asked."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(NoisyPoints(32), batch_size=8, shuffle=True, num_workers=2))
    state = {"model": model, "optimizer": optimizer, "epoch": 0}
    if with_rng:
        state["rng"] = FabricRNGState(loader)
    if resume:
        fabric.load(resume, state)
    for _ in range(state["epoch"], epochs):
        for x, y in loader:
            optimizer.zero_grad()
            fabric.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
        state["epoch"] += 1
    if path:
        fabric.save(path, state)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("with_rng", [True, False], ids=["with-FabricRNGState", "without"])
def test_fabric_save_and_load_resume_bitwise_only_with_the_rng_state(tmp_path, with_rng):
    straight = _train(_fabric(), 3)
    _train(_fabric(), 1, path=tmp_path / "state.ckpt", with_rng=with_rng)
    torch.manual_seed(999)  # whatever happened in between
    resumed = _train(_fabric(), 3, resume=tmp_path / "state.ckpt", with_rng=with_rng)
    same = all(torch.equal(a, b) for a, b in zip(straight, resumed, strict=True))
    assert same is with_rng  # without the RNG state (epoch count, loader generators, streams) the runs part


def _steps(fabric, steps, save_at=None, path=None, resume=None, skip=0, held=True):
    """Dropout and 6 shuffled batches an epoch augmented in this process; ``skip``: batches the resumed loop drops by
    counting (LitGPT's fast-forward); saves after step ``save_at`` (mid-epoch); the weights after ``steps`` steps."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(NoisyPoints(48), batch_size=8, shuffle=True))
    state = {"model": model, "optimizer": optimizer, "rng": FabricRNGState(loader) if held else FabricRNGState()}
    state["step"] = 0
    if resume:
        fabric.load(resume, state)
    if path and save_at == state["step"]:  # loaded and saved again before a batch is drawn
        fabric.save(path, state)
    while state["step"] < steps:
        for x, y in loader:
            if skip:
                skip -= 1
                continue
            optimizer.zero_grad()
            fabric.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            state["step"] += 1
            if state["step"] == save_at:
                fabric.save(path, state)
            if state["step"] == steps:
                break
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_a_mid_epoch_save_resumes_bitwise_whether_or_not_the_loop_skips_the_consumed_batches(tmp_path):
    straight = _steps(_fabric(), 10, save_at=3, path=tmp_path / "mid.ckpt")  # 3 of 6 batches into epoch 0
    torch.manual_seed(999)  # whatever happened in between
    resumed = _steps(_fabric(), 10, resume=tmp_path / "mid.ckpt")  # the loader serves the rest of the epoch
    torch.manual_seed(999)
    counted = _steps(_fabric(), 10, resume=tmp_path / "mid.ckpt", skip=3)  # LitGPT: drops as many as it trained
    assert torch.equal(resumed, straight) and torch.equal(counted, straight)
    _steps(_fabric(), 3, save_at=3, path=tmp_path / "again.ckpt", resume=tmp_path / "mid.ckpt")
    assert torch.equal(_steps(_fabric(), 10, resume=tmp_path / "again.ckpt"), straight)
    with pytest.warns(DeterminismWarning, match="dropped 2 batches of `NoisyPoints`.* written 3 batches into epoch 0"):
        _steps(_fabric(), 5, resume=tmp_path / "mid.ckpt", skip=2)  # another count: other batches, said


def test_a_mid_epoch_save_of_a_loader_no_fabric_rng_state_holds_is_said(tmp_path):
    with pytest.warns(DeterminismWarning, match="`fabric.save` 3 batches into epoch 0 of the loader over `Noisy"):
        _steps(_fabric(), 3, save_at=3, path=tmp_path / "mid.ckpt", held=False)


def _saved_rng_state(tmp_path):
    fabric = _fabric()
    fabric.setup(nn.Linear(1, 1))
    loader = fabric.setup_dataloaders(DataLoader(range(8), batch_size=2, shuffle=True))
    state = FabricRNGState(loader).state_dict()
    return state, loader


def test_a_checkpoint_of_another_world_size_reseeds_with_a_warning(tmp_path):
    state, loader = _saved_rng_state(tmp_path)
    state["ranks"] = state["ranks"] * 2
    state["world_size"] = 2
    with pytest.warns(DeterminismWarning, match="written by 2 ranks and is loaded on 1: each rank reseeds"):
        FabricRNGState(loader).load_state_dict(state)
    next(iter(loader))  # saved one batch into epoch 0: on another world size that epoch starts over
    state = FabricRNGState(loader).state_dict()
    state["ranks"], state["world_size"] = state["ranks"] * 2, 2
    with pytest.warns(DeterminismWarning, match="The interrupted epoch of 1 loader.s. starts over from its start"):
        FabricRNGState(loader).load_state_dict(state)
    assert len(list(loader)) == 4 and loader._num_iter_calls == 1


def test_malformed_or_mismatched_states_are_refused(tmp_path):
    state, loader = _saved_rng_state(tmp_path)
    with pytest.raises(ValueError, match="saved with 1 loader.* loaded into one with 0"):
        FabricRNGState().load_state_dict(state)
    del state["ranks"][0]["digest"]
    with pytest.raises(ValueError, match=r"`FabricRNGState.ranks\[0\]` is malformed: missing 'digest'"):
        FabricRNGState(loader).load_state_dict(state)


def _recorded_loop(fabric, recorder, scale=1.0):
    torch.manual_seed(0)
    model = fabric.setup(nn.Linear(4, 1))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(3):
        loss = model(torch.full((2, 4), float(step))).pow(2).mean() * scale
        optimizer.zero_grad()
        fabric.backward(loss)
        recorder.before_optimizer_step(model)
        optimizer.step()
        recorder.after_optimizer_step(model, loss)
    recorder.finish()


def test_the_baseline_recorder_works_from_a_fabric_loop(tmp_path):
    path = tmp_path / "baseline.json"
    _recorded_loop(_fabric(), BaselineRecorder(path, steps=3))
    assert len(json.loads(path.read_text())["steps"]) == 3
    _recorded_loop(_fabric(), BaselineRecorder(path, steps=3, mode="compare", rtol=0.0, atol=0.0))
    with pytest.raises(BaselineMismatch, match="step 0: loss"):
        _recorded_loop(_fabric(), BaselineRecorder(path, steps=3, mode="compare"), scale=1.01)
