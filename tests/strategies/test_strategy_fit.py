"""Lightning fits with the deterministic DDP strategy on 2 CPU ranks (fork for speed, one real spawn)."""

import logging
import math

import pytest
import torch
from lightning.pytorch import seed_everything
from torch.utils.data import DistributedSampler

from lightning_determinism import DeterministicDDPStrategy
from tests.helpers.lightning_models import (
    IndexDataset,
    RecordingModule,
    build_net,
    fit,
    quiet_trainer,
    read_records,
    reference_draws,
    state_digest,
)

pytestmark = pytest.mark.distributed


@pytest.fixture
def strategy_log(tmp_path):
    # Forked ranks inherit this handler: each writes its own line to the file.
    path = tmp_path / "strategy.log"
    handler = logging.FileHandler(path)
    logger = logging.getLogger("lightning_determinism")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield path
    logger.removeHandler(handler)
    handler.close()
    logger.setLevel(logging.NOTSET)


def test_ranks_get_base_plus_rank_and_log_it(tmp_path, strategy_log):
    torch.manual_seed(99)
    fit(DeterministicDDPStrategy(seed=42, start_method="fork"), tmp_path)
    records = read_records(tmp_path, 2)
    for rank, record in enumerate(records):
        assert record["rank"] == rank
        assert (record["base_seed"], record["local_seed"]) == (42, 42 + rank)
        assert record["draws"] == reference_draws(42 + rank)
        assert record["pl_global_seed"] == "42"
    assert records[0]["dropout"] != records[1]["dropout"]  # ranks draw different masks
    lines = sorted(strategy_log.read_text().splitlines())
    assert lines == [
        "[rank: 0] lightning_determinism: base seed 42, local seed 42, debug_mode=error",
        "[rank: 1] lightning_determinism: base seed 42, local seed 43, debug_mode=error",
    ]


def test_two_runs_are_bitwise_identical(tmp_path):
    for name in ("a", "b"):
        torch.manual_seed(len(name) * 7 + ord(name))  # different parent state each time
        fit(DeterministicDDPStrategy(seed=7, start_method="fork"), tmp_path / name, max_epochs=2)
    a, b = read_records(tmp_path / "a", 2), read_records(tmp_path / "b", 2)
    for rank in range(2):
        assert a[rank]["final_digest"] == b[rank]["final_digest"]
        assert a[rank]["dropout"] == b[rank]["dropout"]
        assert a[rank]["indices"] == b[rank]["indices"]


def test_none_takes_seed_everything_and_sampler_follows_it(tmp_path):
    seed_everything(123, verbose=False)
    fit("ddp_fork_deterministic", tmp_path, n=30, batch_size=5)
    records = read_records(tmp_path, 2)
    dataset = IndexDataset(30)
    for rank, record in enumerate(records):
        assert record["base_seed"] == 123
        assert record["draws"] == reference_draws(123 + rank)
        expected = list(DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=123))
        assert sum(record["indices"], []) == expected
        assert record["train_sampler"] == "DistributedSampler"  # training keeps Lightning's padded sampler


def test_none_without_seed_everything_broadcasts_one_seed(tmp_path, monkeypatch):
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    fit("ddp_fork_deterministic", tmp_path)
    records = read_records(tmp_path, 2)
    base = records[0]["base_seed"]
    assert records[1]["base_seed"] == base
    assert records[0]["pl_global_seed"] == records[1]["pl_global_seed"] == str(base)
    for rank, record in enumerate(records):
        assert record["draws"] == reference_draws(base + rank)


def test_initial_weights_match_across_ranks_and_single_process(tmp_path):
    fit(DeterministicDDPStrategy(seed=11, start_method="fork"), tmp_path / "ddp")
    from lightning_determinism import DeterministicSingleDeviceStrategy

    fit(DeterministicSingleDeviceStrategy(seed=11), tmp_path / "single", devices=1)
    ddp, single = read_records(tmp_path / "ddp", 2), read_records(tmp_path / "single", 1)
    torch.manual_seed(11)
    reference = state_digest(build_net())  # independent: the net built right after seeding with the base seed
    assert ddp[0]["init_digest"] == ddp[1]["init_digest"] == single[0]["init_digest"] == reference
    assert ddp[0]["digest_at_start"] == ddp[1]["digest_at_start"] == reference
    assert single[0]["draws"] == reference_draws(11)


@pytest.mark.parametrize(
    ("debug_mode", "expected"),
    [
        ("error", {"deterministic": True, "warn_only": False, "cudnn_deterministic": True, "cudnn_benchmark": False}),
        ("warn", {"deterministic": True, "warn_only": True, "cudnn_deterministic": True, "cudnn_benchmark": False}),
        (
            "default",
            {"deterministic": False, "warn_only": False, "cudnn_deterministic": False, "cudnn_benchmark": True},
        ),
    ],
)
def test_backend_flags_follow_debug_mode(tmp_path, debug_mode, expected):
    fit(DeterministicDDPStrategy(seed=1, debug_mode=debug_mode, start_method="fork"), tmp_path)
    for record in read_records(tmp_path, 2):
        flags = dict(record["flags"])
        flags.pop("cublas")
        assert flags == expected


def test_debug_mode_none_leaves_flags_alone(tmp_path):
    torch.backends.cudnn.benchmark = True  # forked ranks inherit this
    fit(DeterministicDDPStrategy(seed=1, debug_mode=None, start_method="fork"), tmp_path)
    for record in read_records(tmp_path, 2):
        assert record["flags"]["cudnn_benchmark"] is True
        assert record["flags"]["deterministic"] is False


def test_spawn_path(spawn_fit):
    records = read_records(spawn_fit, 2)  # the fit: conftest.py's spawn_fit
    for rank, record in enumerate(records):
        assert (record["base_seed"], record["local_seed"]) == (5, 5 + rank)
        assert record["draws"] == reference_draws(5 + rank)
    assert records[0]["init_digest"] == records[1]["init_digest"]
    # compute() synced both ranks' states: 16 samples seen in all, the same value on each rank.
    assert [r["train_count"] for r in records] == [16, 16]
    assert records[0]["train_ppl"] == records[1]["train_ppl"] and math.isfinite(records[0]["train_ppl"])
    assert records[0]["train_mean"] == records[1]["train_mean"]


class _WithUnusedParameter(RecordingModule):
    """A parameter no loss reaches: stock DDP refuses it unless told to look for unused parameters."""

    def configure_model(self):
        super().configure_model()
        if not hasattr(self, "unused"):
            self.unused = torch.nn.Linear(2, 2)


@pytest.mark.parametrize("name", ["ddp_fork_find_unused_parameters_true_deterministic", "ddp_fork_deterministic"])
def test_the_find_unused_parameters_names_have_deterministic_twins(tmp_path, name):
    seed_everything(5, verbose=False)
    trainer = quiet_trainer(name, 2, max_epochs=1, default_root_dir=str(tmp_path))
    assert isinstance(trainer.strategy, DeterministicDDPStrategy)
    if name == "ddp_fork_deterministic":  # the reference: without the flag, DDP refuses the unused parameter
        with pytest.raises(Exception, match="find_unused_parameters"):
            trainer.fit(_WithUnusedParameter(str(tmp_path)))
        return
    assert trainer.strategy._ddp_kwargs == {"find_unused_parameters": True}
    trainer.fit(_WithUnusedParameter(str(tmp_path)))
    for rank, record in enumerate(read_records(tmp_path, 2)):
        assert (record["base_seed"], record["local_seed"]) == (5, 5 + rank)
        assert record["draws"] == reference_draws(5 + rank)
