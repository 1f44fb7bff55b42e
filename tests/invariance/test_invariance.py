"""World-size-invariant training: the same bits on 1, 2 and 4 gloo processes, elastic resume, and the refusals.

Dropout, shuffled data augmented in 2 workers per process (WorkerSeedCallback(per_sample=True)), gradient clipping,
Adam and a StepLR scheduler; B = 16 samples per step in 4 micro-batches of 4, 64 samples, 3 epochs (12 steps)."""

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_determinism import (
    DeterministicDDPStrategy,
    DeterministicSingleDeviceStrategy,
    NumericalBaseline,
    WorkerSeedCallback,
    compare_baselines,
    load_baseline,
)
from lightning_determinism.invariance.invariant import InvariantSampler, InvariantTraining
from tests.helpers.lightning_models import InvariantModule, quiet_trainer

pytestmark = pytest.mark.distributed

INVARIANT = {"global_batch_size": 16, "micro_batch_size": 4}


def _fit(
    out, strategy, devices, workers=2, ckpt=None, save_every_step=False, baseline=False, module=None, **trainer_kwargs
):
    out.mkdir(parents=True, exist_ok=True)
    callbacks = [WorkerSeedCallback(per_sample=True)]
    if baseline:
        callbacks.append(NumericalBaseline(out / "baseline.json", steps=6))  # past the first epoch (4 steps)
    if save_every_step:
        callbacks.append(ModelCheckpoint(dirpath=out, every_n_train_steps=1, save_top_k=-1, filename="{step}"))
    trainer = quiet_trainer(
        strategy, devices, max_epochs=3, gradient_clip_val=0.5, callbacks=callbacks,
        enable_checkpointing=save_every_step, **trainer_kwargs,
    )  # fmt: skip
    trainer.fit(module or InvariantModule(str(out), workers=workers), ckpt_path=ckpt)
    return torch.load(out / "invariant.pt", weights_only=True)


def _ddp(**kwargs):
    return DeterministicDDPStrategy(seed=5, start_method="fork", **kwargs)


def assert_bitwise(a, b):
    assert a["params"].keys() == b["params"].keys()
    for name in a["params"]:
        assert torch.equal(a["params"][name], b["params"][name]), name
    for index, state in a["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(value, b["optimizer"]["state"][index][key]), (index, key)
    assert a["scheduler"] == b["scheduler"] and a["global_step"] == b["global_step"] == 12


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("invariant")
    results = {w: _fit(root / f"w{w}", _ddp(**INVARIANT), w, save_every_step=w == 2, baseline=True) for w in (1, 2, 4)}
    return root, results


def test_one_two_and_four_processes_give_the_same_bits(runs):
    _, results = runs
    assert_bitwise(results[1], results[2])
    assert_bitwise(results[1], results[4])
    assert results[1]["losses"] == results[2]["losses"] == results[4]["losses"]  # the synced, logged loss
    assert len(results[1]["losses"]) == 3


def test_the_bits_are_release_0_1_0s(runs):
    # The final parameters and optimizer state that release 0.1.0 (b58633f) gave for these fits on torch 2.13: the
    # reduction changed since (chunks exchanged, not whole gradients), its sums did not.
    from lightning_determinism import fingerprint

    _, results = runs
    version = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    if version != "2.13":
        pytest.skip(f"release 0.1.0's fingerprint is pinned for torch 2.13, not {torch.__version__}")
    assert fingerprint({"params": results[4]["params"], "optimizer": results[4]["optimizer"]}) == (
        "05ec289236291a16b77d76500832323666c8f55b0cc7e730ccb26a306347659f"
    )


def test_baselines_of_one_two_and_four_processes_compare_equal_bitwise(runs):
    root, results = runs
    files = {w: load_baseline(root / f"w{w}" / "baseline.json") for w in (1, 2, 4)}
    for w in (2, 4):
        out = compare_baselines(files[1], files[w], rtol=0.0, atol=0.0)
        assert out["first"] is None, out["first"]
        assert all(row["bitwise_params"] for row in out["rows"]) and len(out["rows"]) == 6
        assert [s["loss"] for s in files[1]["steps"]] == [s["loss"] for s in files[w]["steps"]]
    # The recorded loss is the step's: the mean over its 4 micro-batches of m=4 samples, i.e. over its 16 samples.
    # An independent reference: the epoch means (DistributedMean over every sample) of the same run.
    first_epoch = sum(s["loss"] for s in files[1]["steps"][:4]) / 4
    assert abs(first_epoch - float.fromhex(results[1]["losses"][0])) < 1e-6 * abs(first_epoch)


def test_a_single_device_strategy_gives_the_same_bits(runs, tmp_path):
    _, results = runs
    single = _fit(tmp_path, DeterministicSingleDeviceStrategy(seed=5, device="cpu", **INVARIANT), 1)
    assert_bitwise(results[1], single)


def test_ddp_reducer_copies_no_gradient_in_the_invariant_mode(tmp_path):
    # The tree sums the gradients itself; DDP's reducer, left on for each step's last micro-batch (the only one
    # outside `no_sync`), would copy every gradient into its buckets and back for nothing (~10% of an MLP's step).
    import lightning as L

    seen = tmp_path / "sync.txt"  # the fit runs in a forked rank

    class Watch(L.Callback):
        def on_after_backward(self, trainer, pl_module):
            with open(seen, "a") as f:
                f.write(f"{trainer.strategy.model.require_backward_grad_sync}\n")

    trainer = quiet_trainer(_ddp(**INVARIANT), 1, max_steps=2, callbacks=[Watch()], enable_checkpointing=False)
    trainer.fit(InvariantModule(str(tmp_path), workers=0))
    assert seen.read_text().split() == ["False"] * 8  # 2 steps of 4 micro-batches, none with DDP's sync


def test_each_steps_seeds_are_hashed_before_it_starts(tmp_path, monkeypatch):
    # The next step's key words are hashed in the last micro-batch's after_backward (while a multi-process run's
    # gradients are in flight), so every step after the first finds its state prepared at its first micro-batch.
    import inspect

    from lightning_determinism.seeding.seeds import StepSeeds

    callers = []
    original = StepSeeds._step_state

    def recording(self, step):
        callers.append((step, inspect.stack()[1].function))
        return original(self, step)

    monkeypatch.setattr(StepSeeds, "_step_state", recording)
    strategy = DeterministicSingleDeviceStrategy(seed=5, device="cpu", **INVARIANT)  # in this process
    trainer = quiet_trainer(strategy, 1, max_steps=3, enable_checkpointing=False)
    trainer.fit(InvariantModule(str(tmp_path), workers=0))
    assert callers == [(0, "__call__"), (1, "prepare"), (2, "prepare"), (3, "prepare")]


@pytest.mark.parametrize("step", [4, 6], ids=["epoch-boundary", "mid-epoch"])
def test_a_checkpoint_of_two_processes_resumes_on_one_and_on_four(runs, tmp_path, step):
    root, results = runs
    for world in (1, 4):
        # Checkpointing every step as the docs recommend: the resumed run's first micro-batches (K = 4 / W of them per
        # step) leave global_step where it was; none of them may save the resumed step again, mid-accumulation.
        ckpt = root / "w2" / f"step={step}.ckpt"
        resumed = _fit(tmp_path / f"w{world}", _ddp(**INVARIANT), world, ckpt=ckpt, save_every_step=True)
        assert_bitwise(results[1], resumed)


def test_plain_deterministic_ddp_is_not_invariant(tmp_path):
    # The same micro-batches per step (accumulate_grad_batches = 4 / W), but DDP's float all-reduce and per-rank
    # streams: the test above could fail.
    one = _fit(tmp_path / "w1", _ddp(), 1, workers=0, accumulate_grad_batches=4)
    two = _fit(tmp_path / "w2", _ddp(), 2, workers=0, accumulate_grad_batches=2)
    assert any(not torch.equal(one["params"][k], two["params"][k]) for k in one["params"])


def test_plain_ddp_baselines_compare_equal_to_one_process_with_the_same_global_batches(tmp_path):
    # Accumulation 4 on one process against 2 on each of two, both under the DDP strategy: Lightning's
    # DistributedSampler draws one permutation from the seed whatever the world size, and rank r takes every W-th
    # index, so each optimizer step sees the same 16 samples. The recorded loss is the step's mean over all
    # micro-batches and ranks, so the runs compare equal within the default tolerance (DDP sums in float: not bitwise).
    def module(out):
        return InvariantModule(str(out), workers=0, dropout=0.0)

    _fit(tmp_path / "w1", _ddp(), 1, baseline=True, module=module(tmp_path / "w1"), accumulate_grad_batches=4)
    _fit(tmp_path / "w2", _ddp(), 2, baseline=True, module=module(tmp_path / "w2"), accumulate_grad_batches=2)
    one, two = (load_baseline(tmp_path / w / "baseline.json") for w in ("w1", "w2"))
    out = compare_baselines(one, two, rtol=1e-4, atol=1e-6)
    assert out["first"] is None, out["first"]
    # The losses agree to float rounding, far closer than a micro-batch's loss would (what was recorded before).
    for a, b in zip(one["steps"], two["steps"], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(a["loss"]), (a["step"], a["loss"], b["loss"])


def test_the_setup_says_once_what_it_fixed(tmp_path, caplog):
    import logging

    with caplog.at_level(logging.INFO):
        _fit(tmp_path, DeterministicSingleDeviceStrategy(seed=5, device="cpu", **INVARIANT), 1, workers=0)
    lines = [r.getMessage() for r in caplog.records if "world-size-invariant training" in r.getMessage()]
    assert len(lines) == 1
    assert "B=16 samples per optimizer step in 4 micro-batches of m=4; 1 process(es) x 4 micro-batches" in lines[0]
    assert "valid world sizes: [1, 2, 4]" in lines[0]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"global_batch_size": 16}, ValueError, "needs both `global_batch_size` and `micro_batch_size`"),
        ({"global_batch_size": 24, "micro_batch_size": 4}, ValueError, r"must be a power of two .* 24 / 4 = 6"),
        ({"global_batch_size": 16, "micro_batch_size": 3}, ValueError, r"`micro_batch_size` must divide"),
        ({"global_batch_size": 16.0, "micro_batch_size": 4}, TypeError, "`global_batch_size` must be a positive int"),
        ({**INVARIANT, "debug_mode": None}, ValueError, "needs deterministic kernels: `debug_mode` must be 'warn'"),
        ({**INVARIANT, "topology": {"mp_degree": 1}}, ValueError, "data-parallel only"),
    ],
)
def test_bad_settings_are_refused_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        DeterministicDDPStrategy(**kwargs)


def test_a_world_size_that_does_not_split_the_step_is_refused():
    with pytest.raises(ValueError, match=r"runs on \[1, 2, 4\] processes, got 3"):
        InvariantTraining(16, 4).setup_environment(0, 3, 0)


def test_a_wrong_world_size_is_refused_once_in_the_main_process_when_the_trainer_is_built():
    import lightning as L

    with pytest.raises(ValueError, match=r"runs on \[1, 2, 4\] processes, got 3"):
        L.Trainer(strategy=_ddp(**INVARIANT), accelerator="cpu", devices=3)


class _BatchNormModule(InvariantModule):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)  # built here, not in configure_model: the main process can see it
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))


@pytest.mark.parametrize(
    ("module", "trainer_kwargs", "match"),
    [
        (InvariantModule, {"accumulate_grad_batches": 3}, r"`accumulate_grad_batches=3` contradicts"),
        (_BatchNormModule, {}, r"cannot keep batch-norm running statistics invariant: `net.1`"),
        (InvariantModule, {"callbacks": [WorkerSeedCallback()]}, r"needs `WorkerSeedCallback\(per_sample=True\)`"),
    ],
    ids=["accumulation", "batch-norm", "per-worker-seeds"],
)
def test_refusals_known_before_launch_are_raised_by_the_main_process(tmp_path, module, trainer_kwargs, match):
    # A rank's failure would come back from the fork launcher as a ProcessRaisedException after every rank printed
    # its traceback; a plain ValueError means the main process refused before starting any rank.
    trainer = quiet_trainer(_ddp(**INVARIANT), 2, max_epochs=1, **trainer_kwargs)
    with pytest.raises(ValueError, match=match):
        trainer.fit(module(str(tmp_path), workers=0))


def test_a_dataset_length_the_global_batch_does_not_divide_is_refused():
    with pytest.raises(ValueError, match=r"got 60 samples for B=16 \(12 left over\)"):
        InvariantSampler(60, 16, 4, world_size=2, rank=0, seed=0)


def test_loaders_that_cannot_be_cut_into_micro_batches_are_refused():
    invariant = InvariantTraining(16, 4)
    with pytest.raises(ValueError, match="`batch_size` must be the micro-batch size m=4, got 8"):
        invariant.process_train_loader(DataLoader(list(range(64)), batch_size=8), 0, 1)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(64))

    with pytest.raises(ValueError, match="needs a map-style dataset.*got a `Stream`"):
        invariant.process_train_loader(DataLoader(Stream(), batch_size=4), 0, 1)


def test_batch_norm_manual_optimization_and_a_contradicting_accumulation_are_refused_at_setup(tmp_path):
    class WithBatchNorm(InvariantModule):
        def configure_model(self):
            super().configure_model()
            self.norm = torch.nn.BatchNorm1d(8)

    strategy = DeterministicSingleDeviceStrategy(seed=5, device="cpu", **INVARIANT)
    with pytest.raises(ValueError, match="cannot keep batch-norm running statistics invariant: `norm`"):
        quiet_trainer(strategy, 1, max_epochs=1).fit(WithBatchNorm(str(tmp_path), workers=0))

    class Manual(InvariantModule):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.automatic_optimization = False

    strategy = DeterministicSingleDeviceStrategy(seed=5, device="cpu", **INVARIANT)
    with pytest.raises(ValueError, match="needs `automatic_optimization=True`"):
        quiet_trainer(strategy, 1, max_epochs=1).fit(Manual(str(tmp_path), workers=0))
    strategy = DeterministicSingleDeviceStrategy(seed=5, device="cpu", **INVARIANT)
    with pytest.raises(ValueError, match=r"`accumulate_grad_batches=3` contradicts .* = 4 micro-batches"):
        quiet_trainer(strategy, 1, max_epochs=1, accumulate_grad_batches=3).fit(InvariantModule(str(tmp_path)))
    # One device has no launcher: per-worker seeds are refused in `setup`; per-sample seeds are not.
    strategy = DeterministicSingleDeviceStrategy(seed=5, device="cpu", **INVARIANT)
    trainer = quiet_trainer(strategy, 1, max_epochs=1, callbacks=[WorkerSeedCallback(per_sample=False)])
    with pytest.raises(ValueError, match=r"needs `WorkerSeedCallback\(per_sample=True\)`, got `per_sample=False`"):
        trainer.fit(InvariantModule(str(tmp_path), workers=0))


def test_lightning_cli_yaml_turns_it_on(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 1\n  logger: false\n  strategy:\n"
        "    class_path: lightning_determinism.DeterministicSingleDeviceStrategy\n"
        "    init_args:\n      device: cpu\n      global_batch_size: 16\n      micro_batch_size: 4\n"
        f"model:\n  out_dir: {tmp_path}\n"
    )
    cli = LightningCLI(InvariantModule, run=False, args=["--config", str(config)], save_config_callback=None)
    invariant = cli.trainer.strategy.invariant
    assert (invariant.global_batch_size, invariant.micro_batch_size, invariant.micro_batches) == (16, 4, 4)
