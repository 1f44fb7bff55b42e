"""The Trainer's `deterministic` and `benchmark` against the strategy's `debug_mode`: one rule, said or refused.

A flag the user gave is never silently overridden: `deterministic` decides the mode where the strategy was given none,
both given must agree, `benchmark=True` is kept under "default" and refused where kernels must be deterministic. The
torch flags are read inside the fit, where the strategy has applied its mode.
"""

import logging

import lightning as L
import pytest
import torch

from lightning_determinism import DeterministicDDPStrategy, DeterministicSingleDeviceStrategy
from tests.helpers.lightning_models import quiet_trainer


def _trainer(strategy, **flags):
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, **flags)  # fmt: skip


class _Flags(L.LightningModule):
    """Records torch's determinism flags as the first training step sees them."""

    def __init__(self):
        super().__init__()
        self.net, self.seen = torch.nn.Linear(2, 1), None

    def training_step(self, batch, batch_idx):
        if self.seen is None:
            warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
            self.seen = (torch.are_deterministic_algorithms_enabled(), warn_only, torch.backends.cudnn.benchmark)
        return self.net(batch[0]).sum()

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 2)), batch_size=2)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize(
    ("deterministic", "mode", "seen"),
    [
        ("warn", 1, (True, True, False)),  # it used to become an error (crashing on ops without a deterministic form)
        (True, 2, (True, False, False)),
        (False, 0, (False, False, True)),  # "default": torch's own kernels, cuDNN benchmark on
        (None, 2, (True, False, False)),  # not given: the strategy's default, "error"
    ],
)
def test_deterministic_decides_the_mode_where_the_strategy_was_given_none(deterministic, mode, seen, caplog):
    strategy = DeterministicSingleDeviceStrategy(seed=1, device="cpu")
    module = _Flags()
    with caplog.at_level(logging.INFO):
        quiet_trainer(strategy, 1, max_steps=1, deterministic=deterministic).fit(module)
    assert strategy._ldet_steps.debug_mode == mode and module.seen == seen
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Trainer(deterministic=")]
    if deterministic in ("warn", False):  # it decided: said in one line
        assert said == [f"Trainer(deterministic={deterministic!r}): DeterministicSingleDeviceStrategy's debug_mode is"
                        f" {['default', 'warn'][mode]!r}"]  # fmt: skip
    else:
        assert said == []


def test_a_strategy_given_by_name_follows_too():
    trainer = _trainer("ddp_deterministic", deterministic="warn")
    assert trainer.strategy._ldet_steps.debug_mode == 1


@pytest.mark.parametrize(
    ("debug_mode", "flags", "match"),
    [
        ("error", {"deterministic": "warn"}, r"Trainer\(deterministic='warn'\) contradicts .*\(debug_mode='error'\)"),
        ("default", {"deterministic": True}, r"Trainer\(deterministic=True\) contradicts .*\(debug_mode='default'\)"),
        ("warn", {"deterministic": False}, r"Trainer\(deterministic=False\) contradicts .*\(debug_mode='warn'\)"),
        ("error", {"benchmark": True}, r"Trainer\(benchmark=True\) lets cuDNN pick .* contradicts .*'error'"),
        ("(not given)", {"benchmark": True}, r"Trainer\(benchmark=True\) .* contradicts .*'error'"),
    ],
    ids=["warn-vs-error", "true-vs-default", "false-vs-warn", "benchmark-vs-error", "benchmark-vs-default-mode"],
)
def test_contradictions_are_refused_when_the_trainer_is_built(debug_mode, flags, match):
    given = {} if debug_mode == "(not given)" else {"debug_mode": debug_mode}  # not given: the default, "error"
    with pytest.raises(ValueError, match=match):
        _trainer(DeterministicDDPStrategy(seed=1, **given), **flags)


@pytest.mark.parametrize(
    ("debug_mode", "flags", "mode", "benchmark"),
    [
        ("warn", {"deterministic": "warn"}, 1, None),  # both alike
        ("error", {"deterministic": True, "benchmark": False}, 2, False),
        ("default", {"benchmark": False}, 0, False),  # the user's benchmark kept under "default"
        ("default", {"benchmark": True}, 0, True),
        (None, {"deterministic": True, "benchmark": True}, None, None),  # None: every flag left to the Trainer
    ],
)
def test_agreeing_flags_are_accepted(debug_mode, flags, mode, benchmark):
    steps = _trainer(DeterministicDDPStrategy(seed=1, debug_mode=debug_mode), **flags).strategy._ldet_steps
    assert (steps.debug_mode, steps.benchmark) == (mode, benchmark)


def test_the_users_benchmark_false_holds_under_default_in_the_fit():
    module = _Flags()
    strategy = DeterministicSingleDeviceStrategy(seed=1, device="cpu", debug_mode="default")
    quiet_trainer(strategy, 1, max_steps=1, benchmark=False).fit(module)
    assert module.seen == (False, False, False)  # "default" alone turns cuDNN benchmark on


def test_the_invariant_mode_refuses_deterministic_false():
    strategy = DeterministicDDPStrategy(seed=1, global_batch_size=8, micro_batch_size=2)
    with pytest.raises(ValueError, match=r"needs deterministic kernels: Trainer\(deterministic=False\) turns them off"):
        _trainer(strategy, deterministic=False)


def test_what_the_flags_decided_travels_to_spawned_ranks():
    import pickle

    # A spawn launcher pickles the strategy: its ranks apply the mode and benchmark the main process settled
    for strategy, flags, want in (
        ("ddp_spawn_deterministic", {"deterministic": "warn"}, (1, None)),
        (DeterministicDDPStrategy(seed=1, debug_mode="default"), {"benchmark": False}, (0, False)),
    ):
        steps = pickle.loads(pickle.dumps(_trainer(strategy, **flags).strategy))._ldet_steps
        assert (steps.debug_mode, steps.benchmark) == want
