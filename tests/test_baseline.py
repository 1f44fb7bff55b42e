"""NumericalBaseline record/compare in one process, and the lightning-determinism command."""

import json
import math

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_determinism import DeterminismWarning, DeterministicSingleDeviceStrategy, NumericalBaseline
from lightning_determinism.callbacks.baseline import BaselineMismatch
from lightning_determinism.cli import main as cli
from tests.helpers import requires_cuda
from tests.lightning_models import quiet_trainer


class Small(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = None

    def configure_model(self) -> None:
        if self.net is None:
            self.net = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(48, 6, generator=gen), torch.randn(48, 1, generator=gen)), 8)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ScaleGrad(L.Callback):
    """The deliberate perturbation: one parameter's gradient changes at one step."""

    def __init__(self, step: int, name: str) -> None:
        self.step, self.name = step, name

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == self.step:
            dict(pl_module.named_parameters())[self.name].grad.mul_(1.5)


def run(callbacks, steps=5):
    trainer = quiet_trainer(DeterministicSingleDeviceStrategy(seed=2), 1, max_steps=steps, callbacks=callbacks)
    trainer.fit(Small())


@pytest.fixture
def recorded(tmp_path):
    path = tmp_path / "base.json"
    run([NumericalBaseline(path, steps=5)])
    return path


def test_record_writes_every_quantity(recorded):
    data = json.loads(recorded.read_text())
    assert data["format"] == 1 and data["world_size"] == 1 and len(data["steps"]) == 5
    step = data["steps"][0]
    names = {"net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"}
    assert set(step["grad_norms"]) == set(step["param_norms"]) == set(step["param_fingerprints"]) == names
    assert math.isclose(step["grad_norm"], math.sqrt(sum(v * v for v in step["grad_norms"].values())))


def test_the_same_run_passes_compare_bitwise(recorded, tmp_path):
    run([NumericalBaseline(recorded, steps=5, mode="compare", rtol=0.0, atol=0.0)])


def test_a_perturbed_run_is_caught_at_the_right_step_and_parameter(recorded):
    expected = json.loads(recorded.read_text())["steps"][3]["grad_norms"]["net.2.bias"]
    with pytest.raises(BaselineMismatch, match=r"step 3: grad_norms\[net\.2\.bias\] is .*the baseline .* has") as info:
        run([ScaleGrad(3, "net.2.bias"), NumericalBaseline(recorded, steps=5, mode="compare")])
    assert repr(expected) in str(info.value) and "difference" in str(info.value)


def test_warn_mode_warns_once(recorded):
    with pytest.warns(DeterminismWarning, match="step 2: grad_norms") as record:
        run([ScaleGrad(2, "net.0.bias"), NumericalBaseline(recorded, steps=5, mode="compare", on_mismatch="warn")])
    assert sum("grad_norms" in str(w.message) for w in record) == 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "replay"}, "`mode` must be 'record' or 'compare', got 'replay'"),
        ({"steps": 0}, "`steps` must be a positive int, got 0"),
        ({"rtol": -1.0}, "`rtol` must be a float >= 0, got -1.0"),
        ({"on_mismatch": "ignore"}, "`on_mismatch` must be 'raise' or 'warn'"),
    ],
)
def test_bad_arguments(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        NumericalBaseline(tmp_path / "x.json", **kwargs)


def test_cli_compare_equal_different_and_plot(recorded, tmp_path, capsys):
    perturbed = tmp_path / "perturbed.json"
    run([ScaleGrad(1, "net.2.weight"), NumericalBaseline(perturbed, steps=5)])
    assert cli(["compare", str(recorded), str(recorded)]) == 0
    assert "equal within" in capsys.readouterr().out
    plot = tmp_path / "out.png"
    assert cli(["compare", str(recorded), str(perturbed), "--plot", str(plot)]) == 1
    out = capsys.readouterr().out
    assert "first divergence: step 1, grad_norms[net.2.weight]" in out
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert cli(["compare", str(recorded), str(perturbed), "--rtol", "1", "--atol", "1"]) == 0


def test_cli_bad_files_exit_2_with_the_file_named(recorded, tmp_path, capsys):
    not_json = tmp_path / "notes.txt"
    not_json.write_text("hello")
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"hello": 1}))
    data = json.loads(recorded.read_text())
    shorter = tmp_path / "shorter.json"
    shorter.write_text(json.dumps({**data, "steps": data["steps"][:3]}))
    renamed = tmp_path / "renamed.json"
    steps = [{**s, "grad_norms": {f"x.{k}": v for k, v in s["grad_norms"].items()}} for s in data["steps"]]
    renamed.write_text(json.dumps({**data, "steps": steps}))
    cases = [
        (tmp_path / "missing.json", "missing.json: no such file"),
        (not_json, "notes.txt: not a baseline file (not JSON"),
        (other, "other.json: not a baseline file"),
        (shorter, "different numbers of steps: 5 and 3"),
        (renamed, "different parameter sets at step 0"),
    ]
    for path, message in cases:
        assert cli(["compare", str(recorded), str(path)]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err


def test_cli_plot_without_matplotlib(recorded, tmp_path, capsys, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert cli(["compare", str(recorded), str(recorded), "--plot", str(tmp_path / "p.png")]) == 2
    assert "--plot needs matplotlib: pip install 'lightning-determinism[plot]'" in capsys.readouterr().err


def test_cli_report_text_and_json(capsys, monkeypatch):
    import torch as _torch

    monkeypatch.setattr(_torch.backends.cudnn, "benchmark", True)
    assert cli(["report"]) == 0
    out = capsys.readouterr().out
    assert "nondeterministic: cuDNN benchmark is on" in out and "setting(s) to look at" in out
    assert cli(["report", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cudnn_benchmark"] is True


@requires_cuda
def test_ddp_vs_fsdp_on_gpu(tmp_path):  # pragma: no cover - needs CUDA
    from lightning_determinism import DeterministicFSDPStrategy

    path = tmp_path / "ddp.json"
    for strategy, mode in (("ddp_deterministic", "record"), (DeterministicFSDPStrategy(seed=2), "compare")):
        trainer = L.Trainer(
            strategy=strategy,
            accelerator="cuda",
            devices=1,
            max_steps=5,
            logger=False,
            callbacks=[NumericalBaseline(path, steps=5, mode=mode)],
            enable_checkpointing=False,
        )
        trainer.fit(Small())
