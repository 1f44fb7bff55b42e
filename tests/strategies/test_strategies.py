import importlib
import os

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy, StrategyRegistry

import lightning_determinism
from lightning_determinism import (
    DeterministicDDPStrategy,
    DeterministicFSDPStrategy,
    DeterministicModelParallelStrategy,
    DeterministicSingleDeviceStrategy,
    DeterministicStrategyMixin,
)
from lightning_determinism.strategies.fabric import DeterministicFabricDDPStrategy
from lightning_determinism.strategies.model_parallel import register_model_parallel_strategy
from lightning_determinism.strategies.registry import register_strategies
from tests.helpers import requires_cuda
from tests.helpers.lightning_models import fit, read_records, reference_draws

REGISTERED = {
    "ddp_deterministic": (DeterministicDDPStrategy, "popen"),
    "ddp_spawn_deterministic": (DeterministicDDPStrategy, "spawn"),
    "ddp_fork_deterministic": (DeterministicDDPStrategy, "fork"),
    "ddp_notebook_deterministic": (DeterministicDDPStrategy, "fork"),
    "fsdp_deterministic": (DeterministicFSDPStrategy, None),
    "model_parallel_deterministic": (DeterministicModelParallelStrategy, None),
    "single_device_deterministic": (DeterministicSingleDeviceStrategy, None),
}


@pytest.mark.parametrize("name", sorted(REGISTERED))
def test_names_are_registered_on_import(name):
    cls, start_method = REGISTERED[name]
    strategy = StrategyRegistry.get(name)
    assert type(strategy) is cls
    assert isinstance(strategy, DeterministicStrategyMixin)
    if start_method is not None:
        assert strategy._start_method == start_method


def test_registration_survives_a_second_import_and_call():
    importlib.reload(lightning_determinism)
    assert set(REGISTERED) <= set(register_strategies()) | set(register_model_parallel_strategy())
    assert "ddp_deterministic" in StrategyRegistry


def test_classes_are_the_lightning_strategies():
    assert issubclass(DeterministicDDPStrategy, DDPStrategy)
    assert issubclass(DeterministicFSDPStrategy, FSDPStrategy)
    assert issubclass(DeterministicSingleDeviceStrategy, SingleDeviceStrategy)


def test_trainer_accepts_the_registered_name():
    trainer = L.Trainer(strategy="ddp_fork_deterministic", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, DeterministicDDPStrategy)
    assert trainer.strategy.debug_mode == "error"


@pytest.mark.parametrize(("seed", "error"), [(-1, ValueError), (2**32, ValueError), (1.5, TypeError), ("1", TypeError)])
def test_bad_seed_is_rejected_at_construction(seed, error):
    with pytest.raises(error, match="`seed`"):
        DeterministicDDPStrategy(seed=seed)


def test_bad_debug_mode_is_rejected_at_construction():
    with pytest.raises(ValueError, match="`debug_mode` must be one of"):
        DeterministicDDPStrategy(debug_mode="always")


def test_ddp_arguments_pass_through():
    strategy = DeterministicDDPStrategy(seed=1, debug_mode=None, find_unused_parameters=True, start_method="spawn")
    assert strategy._ddp_kwargs == {"find_unused_parameters": True}
    assert strategy._start_method == "spawn"
    assert (strategy.seed, strategy.debug_mode, strategy.base_seed, strategy.local_seed) == (1, "None", None, None)


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda: DeterministicDDPStrategy(sed=42), "sed"),
        (lambda: DeterministicDDPStrategy(seed=1, invariant=True), "invariant"),  # not an argument of ours
        (lambda: DeterministicSingleDeviceStrategy(seed=1, find_unused_parameters=True), "find_unused_parameters"),
        (lambda: DeterministicFabricDDPStrategy(sed=42), "sed"),
    ],
)
def test_unknown_keywords_are_refused_at_construction_with_the_accepted_ones(make, name):
    # Before, they travelled on to DistributedDataParallel and failed at fit, once per rank.
    with pytest.raises(TypeError, match=rf"unexpected keyword argument\(s\) '{name}'.*; it accepts: .*seed") as info:
        make()
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("strategy", "devices", "num_nodes", "match"),
    [
        (lambda: DeterministicDDPStrategy(seed=2**32 - 1, start_method="fork"), 2, 1,
         r"^`seed` must be in \[0, 4294967294\] for world_size=2, got 4294967295$"),
        (lambda: DeterministicDDPStrategy(seed=2**32 - 3, start_method="fork"), 2, 2,
         r"^`seed` must be in \[0, 4294967292\] for world_size=4, got 4294967293$"),
        (lambda: DeterministicDDPStrategy(topology={"mp_degree": 3}, start_method="fork"), 2, 1,
         r"^`topology=\{'mp_degree': 3\}` does not fit the 2 processes"),
        (lambda: "fsdp_deterministic", 2, 1, r"^`strategy=fsdp_deterministic` .* needs CUDA devices, got 2 CPU device"),
    ],
    ids=["seed-2-ranks", "seed-2-nodes", "topology", "fsdp1-on-cpu"],
)  # fmt: skip
def test_what_the_world_size_refuses_is_refused_once_when_the_trainer_is_built(strategy, devices, num_nodes, match):
    # In the main process, before any rank exists: one error, not one traceback per rank after the launch.
    with pytest.raises(ValueError, match=match) as info:
        L.Trainer(strategy=strategy(), accelerator="cpu", devices=devices, num_nodes=num_nodes, logger=False)
    assert "\n" not in str(info.value)


def test_the_largest_seed_is_accepted_on_one_device():
    strategy = DeterministicSingleDeviceStrategy(seed=2**32 - 1, device="cpu")
    assert L.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False).strategy.seed == 2**32 - 1


def test_setup_before_setup_environment_is_a_clear_error():
    strategy = DeterministicSingleDeviceStrategy(seed=1)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False)
    with pytest.raises(RuntimeError, match=r"setup\(\) ran before setup_environment\(\)"):
        strategy.setup(trainer)


def test_single_device_fit_seeds_base_plus_zero(tmp_path):
    torch.manual_seed(1000)
    fit(DeterministicSingleDeviceStrategy(seed=9), tmp_path, devices=1)
    (record,) = read_records(tmp_path, 1)
    assert (record["base_seed"], record["local_seed"]) == (9, 9)
    assert record["draws"] == reference_draws(9)


def test_lightning_cli_builds_the_strategy_from_a_class_path(tmp_path):
    pytest.importorskip("jsonargparse")
    from lightning.pytorch.cli import LightningCLI

    from tests.helpers.lightning_models import RecordingModule

    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n"
        "  accelerator: cpu\n"
        "  devices: 1\n"
        "  logger: false\n"
        "  strategy:\n"
        "    class_path: lightning_determinism.DeterministicSingleDeviceStrategy\n"
        "    init_args:\n"
        "      seed: 17\n"
        "      debug_mode: warn\n"
        f"model:\n  out_dir: {tmp_path}\n"
    )
    cli = LightningCLI(RecordingModule, run=False, args=["--config", str(config)], save_config_callback=None)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, DeterministicSingleDeviceStrategy)
    assert (strategy.seed, strategy.debug_mode) == (17, "warn")


@requires_cuda
def test_fsdp_on_gpu_seeds_and_flags(tmp_path):
    n = torch.cuda.device_count()
    trainer = L.Trainer(
        strategy=DeterministicFSDPStrategy(seed=21), accelerator="cuda", devices=1, max_epochs=1, logger=False
    )
    from tests.helpers.lightning_models import RecordingModule

    trainer.fit(RecordingModule(str(tmp_path)))
    (record,) = read_records(tmp_path, 1)
    assert (record["base_seed"], record["local_seed"]) == (21, 21)
    assert record["flags"]["deterministic"] is True
    assert n >= 1


def test_cublas_workspace_is_set_when_the_strategy_is_built_where_cuda_is(monkeypatch):
    # Lightning initialises CUDA before setup_environment; the variable must already be there by then.
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    DeterministicDDPStrategy(debug_mode="error")  # no CUDA: the user's process is left alone
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    DeterministicDDPStrategy(debug_mode=None)
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    DeterministicDDPStrategy(debug_mode="warn")
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    DeterministicDDPStrategy(debug_mode="error")
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


@pytest.mark.distributed
def test_the_launching_process_gets_cublas_back_after_a_forked_fit(tmp_path, monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    with monkeypatch.context() as cuda:
        cuda.setattr(torch.cuda, "is_available", lambda: True)
        strategy = DeterministicDDPStrategy(seed=1, start_method="fork")  # where CUDA is: set for the ranks
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    fit(strategy, tmp_path)
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ  # the main process ran no teardown: its launcher put it back


class _EnvInWorkers(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.tensor([float(os.environ.get("PL_GLOBAL_SEED", "-1"))], dtype=torch.float64)


class _EnvModule(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen = []

    def training_step(self, batch, batch_idx):
        self.seen.extend(batch[:, 0].tolist())
        return self.layer(batch.float()).sum()

    def train_dataloader(self):
        return torch.utils.data.DataLoader(_EnvInWorkers(), batch_size=2, num_workers=1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_teardown_restores_the_environment_the_strategy_set(tmp_path):
    for key in ("PL_GLOBAL_SEED", "LDET_BASE_SEED", "LDET_LOCAL_SEED", "CUBLAS_WORKSPACE_CONFIG"):
        os.environ.pop(key, None)
    strategy = DeterministicSingleDeviceStrategy(device="cpu")  # no seed, no seed_everything: one is drawn
    trainer = L.Trainer(
        strategy=strategy, max_epochs=1, logger=False, enable_progress_bar=False, enable_checkpointing=False
    )
    module = _EnvModule()
    trainer.fit(module)
    drawn = strategy.base_seed
    assert module.seen == [float(drawn)] * 4  # the worker process saw the drawn seed during the fit
    for key in ("PL_GLOBAL_SEED", "LDET_BASE_SEED", "LDET_LOCAL_SEED", "CUBLAS_WORKSPACE_CONFIG"):
        assert key not in os.environ, key  # ... and nothing of it is left after the fit
    # Lightning's contract holds again: without seed_everything, reset_seed() does nothing.
    from lightning.fabric.utilities.seed import reset_seed

    torch.manual_seed(5)
    expected = torch.rand(1, generator=torch.Generator().manual_seed(5))
    reset_seed()
    assert torch.equal(torch.rand(1), expected)


def test_teardown_keeps_a_seed_the_user_set(tmp_path):
    L.seed_everything(1234, verbose=False)
    trainer = L.Trainer(
        strategy="single_device_deterministic",
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    trainer.fit(_EnvModule())
    assert os.environ["PL_GLOBAL_SEED"] == "1234"


def test_every_name_the_docs_use_imports_from_the_top_level():
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    text = "\n".join(p.read_text() for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))])
    imported = set()
    for names in re.findall(r"from lightning_determinism import ([\w, ()]+)", text):  # stops at `, #, -->
        imported |= {n.strip(" ()") for n in names.split(",") if n.strip(" ()")}
    public = {n for n in re.findall(r"`([A-Z][A-Za-z]+)`", text) if n in dir(lightning_determinism)}
    for name in sorted(imported | public | {"BaselineMismatch", "tensor_fingerprints", "Topology"}):
        assert hasattr(lightning_determinism, name), name
        assert name in lightning_determinism.__all__, name
    assert lightning_determinism.__all__ == sorted(lightning_determinism.__all__)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tensor_parallel_size": 0}, r"`tensor_parallel_size` must be 'auto' or a positive int, got 0"),
        ({"data_parallel_size": "2"}, r"`data_parallel_size` must be 'auto' or a positive int, got '2'"),
        ({"tensor_parallel_size": 2, "global_batch_size": 8, "micro_batch_size": 4},
         r"it needs `tensor_parallel_size=1`, got 2"),
    ],
)  # fmt: skip
def test_model_parallel_mistakes_are_refused_at_construction(kwargs, match):
    from lightning_determinism import DeterministicModelParallelStrategy

    with pytest.raises(ValueError, match=match):
        DeterministicModelParallelStrategy(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "devices", "match"),
    [
        ({"tensor_parallel_size": 3}, 2, r"resolved: 1 x 3 = 3\) must equal the 2 processes the launcher starts"),
        ({"data_parallel_size": 2, "tensor_parallel_size": 2}, 2, r"resolved: 2 x 2 = 4\) must equal the 2"),
        ({"global_batch_size": 8, "micro_batch_size": 4}, 2, r"it needs `tensor_parallel_size=1`, got 2"),  # auto
    ],
)
def test_a_mesh_that_does_not_fit_the_devices_is_refused_in_the_main_process_before_launch(kwargs, devices, match):
    from lightning_determinism import DeterministicModelParallelStrategy

    class Refused(L.LightningModule):
        def setup(self, stage):  # a rank ran: the refusal came after launch
            raise AssertionError("the ranks were launched")

    strategy = DeterministicModelParallelStrategy(seed=1, start_method="fork", **kwargs)
    with pytest.raises(ValueError, match=match):  # already when the Trainer sets the strategy up
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=1, logger=False,
                            enable_progress_bar=False, enable_checkpointing=False)  # fmt: skip
        trainer.fit(Refused())


@pytest.mark.parametrize(
    ("kwargs", "devices", "match"),
    [
        ({"tensor_parallel_size": 3}, 2, r"resolved: 1 x 3 = 3\) must equal the 2 processes the launcher starts"),
        ({"tensor_parallel_size": 0}, 2, r"`tensor_parallel_size` must be 'auto' or a positive int, got 0"),
    ],
)
def test_fabric_model_parallel_mesh_mistakes_are_refused_before_launch(kwargs, devices, match):
    from lightning_determinism.strategies.fabric import DeterministicFabricModelParallelStrategy

    with pytest.raises(ValueError, match=match):
        strategy = DeterministicFabricModelParallelStrategy(lambda module, mesh: module, seed=1, **kwargs)
        L.Fabric(accelerator="cpu", devices=devices, strategy=strategy)  # no rank launched: fabric.launch() not called


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        ("ddp_find_unused_parameters_true_determinstic", "ddp_find_unused_parameters_true_deterministic"),
        ("DDP_SPAWN_DETERMINSTIC", "ddp_spawn_deterministic"),
        ("fsdp_determinisitc", "fsdp_deterministic"),
    ],
)
def test_a_mistyped_deterministic_name_is_refused_with_the_closest_one(typed, meant):
    with pytest.raises(ValueError, match="invalid strategy name") as caught:
        L.Trainer(strategy=typed, accelerator="cpu", logger=False)
    assert str(caught.value).endswith(f"Did you mean {meant!r}?")


def test_other_mistyped_names_keep_lightnings_message():
    with pytest.raises(ValueError, match="invalid strategy name") as caught:
        L.Trainer(strategy="dpp_spawn", accelerator="cpu", logger=False)
    assert "Did you mean" not in str(caught.value)
