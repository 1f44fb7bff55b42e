"""Resume with Lightning's stateful callbacks equals the uninterrupted run (issue 50), on 1 and 2 gloo processes.

Each scenario is a job as users run one: the uninterrupted run; the same run interrupted right after a checkpoint (in
the middle of an epoch, after an epoch's last batch) and resumed from it in the same directory. Compared bitwise: the
final weights, learning rates, SWA's ``n_averaged``, the epochs EarlyStopping let run, ModelCheckpoint(save_top_k=2)'s
files on disk, a user callback's state (kept in ``on_train_epoch_start/end``, and a loss scale it sets there that no
checkpoint holds), and every value logged (LearningRateMonitor's lr, the validation loss), the interrupted run's and
the resumed run's lines together. Stock Lightning (the default strategy, ``ddp``) is the reference that differs.
"""

import warnings

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from lightning_determinism import DeterminismWarning, DeterministicDDPStrategy, DeterministicSingleDeviceStrategy
from tests.helpers import stateful_callbacks as sc

pytestmark = [
    pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty"),  # the resumed job's
    pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch"),  # stock
    pytest.mark.filterwarnings("ignore:The number of training batches .* is smaller than the logging interval"),
]


def _swa_state_loads_weights_only() -> bool:
    """Whether SWALR's state holds only data (torch 2.8 keeps its anneal function: a weights-only load refuses it)."""
    from torch.optim.swa_utils import SWALR

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    return not any(callable(value) for value in SWALR(optimizer, swa_lr=0.05).state_dict().values())


SWA_LOADS = _swa_state_loads_weights_only()
CONFIGS = [config for config in sc.STEPS if config != "swa" or SWA_LOADS]
RAW_CASES = [(config, name) for config in CONFIGS for name in sc.STEPS[config]]
_NO_SWA = pytest.mark.skipif(
    not SWA_LOADS, reason=f"torch {torch.__version__}'s SWALR keeps a function in its state: not weights-only loadable"
)
CASES = [
    pytest.param(config, name, marks=[_NO_SWA] if config == "swa" else [])
    for config in sc.STEPS
    for name in sc.STEPS[config]
]
COMPARED = ("lr", "epochs", "global_step", "history", "n_averaged", "topk", "log")


def _ours(devices):
    if devices == 1:
        return lambda: DeterministicSingleDeviceStrategy(seed=sc.SEED, device="cpu")
    return lambda: DeterministicDDPStrategy(seed=sc.SEED, start_method="fork")


def _stock(devices):
    return (lambda: "auto") if devices == 1 else (lambda: DDPStrategy(start_method="fork"))


def _run(root, devices, with_more):
    for kind, make in (("ours", _ours(devices)), ("stock", _stock(devices))):
        for config in CONFIGS:
            sc.run_all(root / kind / config, config, make, devices)
        if with_more:
            sc.run_more(root / kind / "more", make, devices)
    return root


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """Every 1-process run, ours and stock Lightning's (~2 s)."""
    return _run(tmp_path_factory.mktemp("one"), 1, with_more=True)


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """Every 2-process run (gloo, forked ranks), ours and stock ``ddp``'s: one job for all the 2-process tests."""
    return _run(tmp_path_factory.mktemp("two"), 2, with_more=False)


def _differences(straight, resumed):
    """The compared fields that differ, per rank (``params``: any weight not bitwise equal)."""
    found = {}
    for rank, want in straight.items():
        got = resumed[rank]
        names = [key for key in COMPARED if got[key] != want[key]]
        if want["params"].keys() != got["params"].keys() or not all(
            torch.equal(want["params"][key], got["params"][key]) for key in want["params"]
        ):
            names.append("params")
        if names:
            found[rank] = names
    return found


def _pair(root, kind, config, name, devices):
    where = root / kind / config
    return sc.read(where / "straight", devices), sc.read(where / name, devices)


def _check_scenario(straight, resumed, config):
    assert _differences(straight, resumed) == {}
    want = straight[0]
    # What the scenario exercises, in the uninterrupted run itself.
    if config == "swa":
        assert (want["epochs"], want["n_averaged"]) == (3, 2)  # EarlyStopping after epoch 2 of 5; averaged twice
        assert want["topk"] == ["epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt"]  # epoch 0's (the worst) removed
    else:
        assert (want["epochs"], want["lr"]) == (5, 0.1 * 0.5**3)  # halved after epochs 2, 3 and 4
    assert any('"lr-SGD"' in line for line in want["log"])  # LearningRateMonitor's lines are compared too


@pytest.mark.parametrize(("config", "name"), CASES)
def test_one_process_resume_is_the_uninterrupted_run(one, config, name):
    _check_scenario(*_pair(one, "ours", config, name, 1), config)


@pytest.mark.distributed
@pytest.mark.parametrize(("config", "name"), CASES)
def test_two_process_resume_is_the_uninterrupted_run(two, config, name):
    _check_scenario(*_pair(two, "ours", config, name, 2), config)


@pytest.mark.parametrize("name", sorted(sc.MORE))
def test_validation_due_at_the_checkpoint_and_a_checkpoint_in_epoch_end_are_replayed(one, name):
    where = one / "ours" / "more" / name
    straight, resumed = sc.read(where / "straight", 1), sc.read(where / "resumed", 1)
    assert _differences(straight, resumed) == {}


def test_stock_lightning_differs_on_one_process(one):
    """The reference: Lightning's own restart, the issue's symptoms (the tests above can fail)."""
    if SWA_LOADS:
        swa_mid, swa_last = (_pair(one, "stock", "swa", name, 1) for name in ("mid-epoch", "last-batch"))
        # Mid-epoch: SWA's scheduler is not rebuilt (the lr lags; nothing is averaged after the resume).
        assert swa_mid[1][0]["lr"] != swa_mid[0][0]["lr"]
        assert swa_mid[1][0]["n_averaged"] != swa_mid[0][0]["n_averaged"]
        # After epoch 1's last batch: its validation is skipped, EarlyStopping runs another epoch, other top-k files.
        assert swa_last[1][0]["epochs"] == swa_last[0][0]["epochs"] + 1
        assert swa_last[1][0]["topk"] != swa_last[0][0]["topk"]
    for name in sc.STEPS["plateau"]:  # ReduceLROnPlateau misses a step: another final lr
        straight, resumed = _pair(one, "stock", "plateau", name, 1)
        assert resumed[0]["lr"] > straight[0]["lr"]
    for name in sc.MORE:
        where = one / "stock" / "more" / name
        assert "log" in _differences(sc.read(where / "straight", 1), sc.read(where / "resumed", 1))[0]


@pytest.mark.distributed
def test_stock_ddp_differs_on_two_processes(two):
    for config, name in RAW_CASES:
        straight, resumed = _pair(two, "stock", config, name, 2)
        assert set(_differences(straight, resumed)) == {0, 1}, (config, name)
    straight, resumed = _pair(two, "stock", "plateau", "last-batch", 2)
    assert resumed[0]["lr"] == resumed[1]["lr"] > straight[0]["lr"]


def test_what_cannot_be_exact_is_warned_at_the_resume(tmp_path):
    """Training's epoch-level values of the interrupted epoch; an epoch-start hook that draws random numbers."""
    make, run = _ours(1), tmp_path / "run"
    options = {"log_train": True, "max_epochs": 2, "extra": (sc.RandomScale(),)}
    sc.fit(run, "plateau", make(), 1, **options)
    with pytest.warns(DeterminismWarning) as warned:
        sc.fit(run, "plateau", make(), 1, ckpt=run / "steps" / "step=6.ckpt", **options)
    lines = [str(w.message) for w in warned if issubclass(w.category, DeterminismWarning)]
    assert len(lines) == 2, lines
    assert "before the end of epoch 1: the epoch-level values of 'train_loss'" in lines[0]
    assert "the on_train_epoch_start hook of RandomScale draws random numbers" in lines[1]


def test_nothing_is_warned_where_the_replay_is_exact(tmp_path):
    make, run = _ours(1), tmp_path / "run"
    sc.fit(run, "plateau", make(), 1, max_epochs=2)
    for step in (6, 8):
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeterminismWarning)
            sc.fit(run, "plateau", make(), 1, ckpt=run / "steps" / f"step={step}.ckpt", max_epochs=2)
