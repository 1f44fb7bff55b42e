"""NumericalBaseline record/compare in one process, and the lightning-determinism command."""

import copy
import json
import math
import pickle
import re

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_determinism import DeterminismWarning, DeterministicSingleDeviceStrategy, NumericalBaseline
from lightning_determinism.callbacks.baseline import BaselineMismatch
from lightning_determinism.divergence.cli import main as cli
from tests.helpers import requires_cuda
from tests.helpers.lightning_models import quiet_trainer


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
    assert data["format"] == 2 and data["world_size"] == 1 and len(data["steps"]) == 5
    step = data["steps"][0]
    names = {"net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"}
    assert set(step["grad_norms"]) == set(step["param_norms"]) == set(step["param_digests"]) == names
    assert all(re.fullmatch("[0-9a-f]{32}", d) for d in step["param_digests"].values())
    assert step["peak_memory_bytes"][0] > 0 and len(step["comm_seconds"]) == 1
    run = data["run"]
    assert run["torch"] == torch.__version__ and run["lightning"] == L.__version__ and run["seed"] == 2
    assert run["strategy"] == "DeterministicSingleDeviceStrategy" and run["precision"] == "32-true"
    assert run["device"] == "cpu" and run["world_size"] == 1 and run["mesh"] is None
    assert run["batch_shape"] == [[8, 6], [8, 1]] and run["memory"] == "cpu_peak_rss_of_process"
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
        ({"rtol": -1.0}, "`rtol` must be a finite float >= 0, got -1.0"),
        ({"atol": float("nan")}, "`atol` must be a finite float >= 0, got nan"),
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
    assert "bitwise identical: 5 steps" in capsys.readouterr().out
    plot = tmp_path / "out.png"
    assert cli(["compare", str(recorded), str(perturbed), "--plot", str(plot)]) == 1
    out = capsys.readouterr().out
    assert "first divergence: step 1, grad_norms[net.2.weight]" in out
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert cli(["compare", str(recorded), str(perturbed), "--rtol", "1", "--atol", "1"]) == 0
    assert "the runs that wrote them differ" not in out  # the same configuration: no cause to name


def test_compare_names_the_run_difference_behind_a_divergence(recorded, tmp_path, capsys):
    # The same run with micro-batches of 4 instead of 8 (as accumulate_grad_batches=2 would cut them): its losses
    # differ from the first step; compare names the batch shape beside the first diverging quantity
    data = json.loads(recorded.read_text())
    data["run"]["batch_shape"] = [[4, 6], [4, 1]]
    data["steps"][0]["loss"] = data["steps"][0]["loss"] * 1.01
    other = tmp_path / "halved.json"
    other.write_text(json.dumps(data))
    assert cli(["compare", str(recorded), str(other)]) == 1
    out = capsys.readouterr().out
    assert "first divergence: step 0, loss" in out
    assert "the runs that wrote them differ in: batch_shape [[8, 6], [8, 1]] vs [[4, 6], [4, 1]]" in out


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
    from lightning_determinism import DeterministicDDPStrategy, DeterministicFSDPStrategy

    path = tmp_path / "ddp.json"
    # One seed and one initial model for both. Built in configure_model, the two would differ: Lightning's FSDP1
    # creates the layers on the CPU (its tensor_init_context enters no device), DDP on the GPU, and the two
    # generators draw other weights from the same seed (seen on an H200, torch 2.11, Lightning 2.6.6).
    runs = ((DeterministicDDPStrategy(seed=2), "record"), (DeterministicFSDPStrategy(seed=2), "compare"))
    for strategy, mode in runs:
        model = Small()
        torch.manual_seed(0)
        model.configure_model()  # on the CPU, before fit: configure_model then keeps it
        trainer = L.Trainer(
            strategy=strategy,
            accelerator="cuda",
            devices=1,
            max_steps=5,
            logger=False,
            callbacks=[NumericalBaseline(path, steps=5, mode=mode)],
            enable_checkpointing=False,
        )
        trainer.fit(model)


def _with_nan(recorded, tmp_path, name, step=2, quantity="loss"):
    data = json.loads(recorded.read_text())
    data["steps"][step][quantity] = float("nan")
    path = tmp_path / name
    path.write_text(json.dumps(data))  # json writes NaN, as NumericalBaseline would for a NaN loss
    return path


def test_cli_nan_is_never_equal_unless_asked(recorded, tmp_path, capsys):
    a, b = _with_nan(recorded, tmp_path, "a.json"), _with_nan(recorded, tmp_path, "b.json")
    assert cli(["compare", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "non-finite: step 2, loss: nan in A, nan in B" in out
    assert "first divergence: step 2, loss: nan vs nan (a non-finite value is never equal" in out
    assert cli(["compare", str(a), str(b), "--nonfinite-equal"]) == 0
    assert "equal within" in capsys.readouterr().out
    # One NaN: the verdict and the table both say so (the max diff is nan, not 0).
    assert cli(["compare", str(recorded), str(b)]) == 1
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("   2 "))
    assert "nan" in row.split()[3:5]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--rtol", "-1"], "argument --rtol: must be a finite number >= 0, got '-1'"),
        (["--atol", "nan"], "argument --atol: must be a finite number >= 0, got 'nan'"),
        (["--rtol", "abc"], "argument --rtol: must be a finite number >= 0, got 'abc'"),
        (["--plot", "/nonexistent/dir/x.png"], "the directory /nonexistent/dir does not exist"),
        (["--plot", "OUT.txt"], "format 'txt' is not one matplotlib writes"),
        (["--plot", "."], "is a directory"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_cli_every_bad_argument_exits_2_with_one_line(recorded, tmp_path, capsys, extra, message):
    assert cli(["compare", str(recorded), str(recorded), *extra]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [
        f"lightning-determinism: error: {captured.err.split('error: ')[1].strip()}"
    ]
    assert message in captured.err and "Traceback" not in captured.err
    assert captured.out == ""  # refused before comparing anything


def test_cli_a_directory_instead_of_a_file(recorded, tmp_path, capsys):
    assert cli(["compare", str(recorded), str(tmp_path)]) == 2
    assert "is a directory, not a baseline file" in capsys.readouterr().err
    assert cli(["report", str(tmp_path)]) == 2
    assert cli([]) == 2 and "required: command" in capsys.readouterr().err


def test_the_figure_says_identical_marks_the_divergence_and_draws_the_tolerance(recorded, tmp_path):
    from lightning_determinism.divergence._compare_plot import make_figure
    from lightning_determinism.divergence.baseline_file import compare_baselines, load_baseline

    data = load_baseline(recorded)
    fig = make_figure(compare_baselines(data, data, 1e-4, 1e-6), "a", "b", 1e-4, 1e-6)
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert "bitwise identical" in texts
    perturbed = tmp_path / "perturbed.json"
    run([ScaleGrad(2, "net.0.weight"), NumericalBaseline(perturbed, steps=5)])
    fig = make_figure(compare_baselines(data, load_baseline(perturbed), 1e-4, 1e-6), "a", "b", 1e-4, 1e-6)
    loss_ax, diff_ax = fig.axes
    assert any("first divergence: step 2" in t.get_text() for t in loss_ax.texts)
    labels = [line.get_label() for line in diff_ax.lines]
    assert "rtol = 0.0001" in labels and "atol = 1e-06" in labels
    ticks = [t for t in diff_ax.get_xticks() if 0 <= t <= 4]
    assert ticks and all(float(t).is_integer() for t in ticks)  # steps, not 0.5, 1.5


def _inside(fig):
    """Whether everything the figure draws lies inside it (a label past the right edge is cut in the PNG) and the
    plots keep their width (tight_layout squeezes them to make room for a label drawn to their right)."""
    fig.canvas.draw()
    drawn = fig.get_tightbbox(fig.canvas.get_renderer())  # inches
    inside = drawn.x0 >= 0 and drawn.y0 >= 0 and drawn.x1 <= fig.get_figwidth() and drawn.y1 <= fig.get_figheight()
    return inside and all(ax.get_position().width > 0.75 for ax in fig.axes)


def test_a_divergence_late_in_the_run_is_labelled_inside_the_figure():
    from lightning_determinism.divergence._compare_plot import make_figure, make_runs_figure

    first = {"step": 15, "name": "param_norms[model.blocks.0.attention.out_proj.weight]", "a": 1.0, "b": 2.0, "diff": 1}
    rows = [{"step": s, "loss_a": 3.0 - s / 10, "loss_b": 3.0 - s / 10, "max_abs": 1e-9 if s < 15 else 0.5,
             "max_rel": 1e-8 if s < 15 else 0.5, "max_rel_grad_norms": 1e-8, "max_tol": 0.01 if s < 15 else 5e3,
             "bitwise_params": False}
            for s in range(20)]  # fmt: skip
    result = {"rows": rows, "first": first, "nonfinite": [], "compared": 20}
    assert _inside(make_figure(result, "one.json", "fault.json", 1e-4, 1e-6))
    healthy = {**result, "first": None, "rows": [{**r, "max_rel": 1e-8, "max_tol": 0.01} for r in rows]}
    runs = [{"name": f"{name}.json", "first": None} for name in ("one", "ddp2", "fsdp2")]
    runs.append({"name": "lr-fault.json", "first": first})
    assert _inside(make_runs_figure({"rtol": 1e-4, "atol": 1e-6, "runs": runs}, [healthy, healthy, result]))


def test_compare_mode_says_once_that_the_run_matched(recorded, caplog):
    import logging

    with caplog.at_level(logging.INFO):
        run([NumericalBaseline(recorded, steps=5, mode="compare")])
    lines = [r.getMessage() for r in caplog.records if "NumericalBaseline:" in r.getMessage()]
    assert lines == [
        f"NumericalBaseline: 5 of 5 steps (10 quantities each) matched {recorded} within rtol=0.0001, atol=1e-06"
    ]


def test_report_describes_a_baseline_file_and_a_checkpoint(recorded, tmp_path, capsys):
    assert cli(["report", str(recorded)]) == 0
    out = capsys.readouterr().out
    assert "NumericalBaseline file" in out and "steps_recorded" in out and "recorded when it was written" in out
    assert re.search(r"^base_seed\s+2$", out, re.M)  # the seed of the run that wrote it, not this process's
    assert re.search(r"^  run\n    torch\s+\S+\n", out, re.M) and re.search(r"^    seed\s+2$", out, re.M)
    from lightning.pytorch.callbacks import ModelCheckpoint

    ckpt_dir = tmp_path / "ckpt"
    trainer = quiet_trainer(
        DeterministicSingleDeviceStrategy(seed=31),
        1,
        max_steps=3,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_last=True)],
    )
    trainer.fit(Small())
    assert cli(["report", str(ckpt_dir / "last.ckpt"), "--json"]) == 0
    described = json.loads(capsys.readouterr().out)
    assert described["base_seed"] == 31 and described["world_size"] == 1 and described["global_step"] == 3
    assert described["report"]["deterministic_algorithms"] is True
    junk = tmp_path / "junk.ckpt"
    junk.write_bytes(b"not a checkpoint")
    assert cli(["report", str(junk)]) == 2
    assert "junk.ckpt: not a checkpoint or baseline file" in capsys.readouterr().err


def test_the_command_keeps_its_exit_codes_in_a_shell_script(recorded, tmp_path):
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    command = shutil.which("lightning-determinism", path=str(Path(sys.executable).parent))
    assert command is not None, "the console script is installed with the package"
    a, b = _with_nan(recorded, tmp_path, "a.json"), _with_nan(recorded, tmp_path, "b.json")
    samples = []  # two evaluations' per-sample records (SampleRecord's files) that disagree on sample 1
    for name, result in (("s1", "0x1.0p+0"), ("s2", "0x1.8p+0")):
        path = tmp_path / name / "determinism_samples_validate.json"
        path.parent.mkdir()
        path.write_text(json.dumps({
            "kind": "lightning_determinism.samples", "format": 1, "stage": "validate", "world_size": 1,
            "batch_invariant": True, "batches": [[0, 0, 0, [0, 1]]],
            "samples": {"0/0": ["0x1.0p+0", 0], "0/1": [result, 0]},
        }))  # fmt: skip
        samples.append(path)
    script = tmp_path / "check.sh"
    script.write_text(
        f"""
{{ "{command}" compare "{recorded}" "{recorded}" > /dev/null; echo "equal $?" > {tmp_path}/codes.1; }} &
{{ "{sys.executable}" -m lightning_determinism compare "{a}" "{b}" > /dev/null; echo "nan $?" > {tmp_path}/codes.2; }} &
{{ "{command}" diagnose "{samples[0]}" "{samples[1]}" > /dev/null; echo "samples $?" > {tmp_path}/codes.4; }} &
"{command}" compare "{recorded}" "{recorded}" --rtol -1 2> {tmp_path}/err.txt; echo "bad $?" > {tmp_path}/codes.3
wait
"""
    )
    subprocess.run(["bash", str(script)], check=True, timeout=300)
    codes = [(tmp_path / f"codes.{i}").read_text().split() for i in (1, 2, 3, 4)]
    assert codes == [["equal", "0"], ["nan", "1"], ["bad", "2"], ["samples", "1"]]
    assert (tmp_path / "err.txt").read_text().count("\n") == 1


def test_cli_compare_needs_two_files_reads_format_1_and_refuses_a_newer_format(recorded, tmp_path, capsys):
    assert cli(["compare", str(recorded)]) == 2
    assert "compare needs two or more baseline files (the first is the reference), got 1" in capsys.readouterr().err
    data = json.loads(recorded.read_text())
    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps({**data, "format": 3}))
    assert cli(["compare", str(recorded), str(newer)]) == 2
    assert "baseline format 3 was written by a newer lightning_determinism" in capsys.readouterr().err
    old_steps = [{k: v for k, v in s.items() if k not in ("param_digests", "peak_memory_bytes", "comm_seconds")}
                 for s in data["steps"]]  # fmt: skip
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"format": 1, "world_size": 1, "steps": old_steps, "report": data["report"]}))
    assert cli(["compare", str(old), str(recorded)]) == 0  # format 1 still compares (no digests: not "bitwise")
    out = capsys.readouterr().out
    assert "equal within rtol=0.0001" in out and re.search(r"old\.json\s+1\s+reference\s+-\s+-", out)


def test_cli_compare_three_files_one_row_each_and_json(recorded, tmp_path, capsys):
    perturbed = tmp_path / "perturbed.json"
    run([ScaleGrad(2, "net.0.bias"), NumericalBaseline(perturbed, steps=5)])
    files = [str(recorded), str(recorded), str(perturbed)]
    assert cli(["compare", *files]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:5] == ["run", "ranks", "numbers", "against", str(recorded)]
    assert "within tolerance (bitwise)" in lines[2] and "step 2, grad_norms[net.0.bias]: " in lines[3]
    assert lines[-1] == f"1 of 2 runs diverge from {recorded} (rtol=0.0001, atol=1e-06)"
    assert cli(["compare", *files, "--json", "--rtol", "1", "--atol", "1"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert [r["verdict"] for r in table["runs"]] == ["reference", "within tolerance", "within tolerance"]
    assert table["rtol"] == 1.0 and table["diverged"] == 0 and table["runs"][1]["bitwise"] is True


class Snapshot(L.Callback):
    """Deep-copies and pickles ``baseline`` in the middle of its record (steps pending, costs measured)."""

    def __init__(self, baseline, step: int) -> None:
        self.baseline, self.step, self.copies = baseline, step, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            self.copies = [copy.deepcopy(self.baseline), pickle.loads(pickle.dumps(self.baseline))]


def test_a_pickled_or_copied_callback_records_the_same_steps(recorded, tmp_path):
    # A spawn launcher pickles the callbacks; a user may deep-copy a configured callback for several runs. A clone
    # taken before the run, or in the middle of a record (steps pending, costs measured), writes what the original
    # did once it runs a fit of its own.
    strip = ("peak_memory_bytes", "comm_seconds")

    def numbers(path):
        return [{k: v for k, v in s.items() if k not in strip} for s in json.loads(path.read_text())["steps"]]

    pickled = pickle.loads(pickle.dumps(NumericalBaseline(tmp_path / "pickled.json", steps=5)))
    run([pickled])
    middle = NumericalBaseline(tmp_path / "middle.json", steps=5)
    snapshot = Snapshot(middle, step=2)
    run([middle, snapshot])
    assert len(snapshot.copies) == 2 and all(len(c.records) == 2 for c in snapshot.copies)
    for i, clone in enumerate(snapshot.copies):
        clone.path = tmp_path / f"clone{i}.json"
        run([clone])  # a new fit: setup starts the record again
    for name in ("pickled.json", "middle.json", "clone0.json", "clone1.json"):
        assert numbers(tmp_path / name) == numbers(recorded), name
