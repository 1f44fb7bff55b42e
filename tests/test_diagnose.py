"""The divergence probe and `diagnose` on pairs of runs with one known fault each; the checkpoint bisection.

Every fault pair is a 3-step single-process fit of ``FaultNet`` against one shared reference run. The fault suite's
score in docs/diagnose.md is this table; the distributed pairs (reduction, invariant mode on 1 and 2 processes) are in
``tests/distributed/test_diagnose_dist.py``.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_determinism import (
    DeterministicSingleDeviceStrategy,
    DivergenceProbe,
    ProbeFileError,
    bisect_checkpoints,
    diagnose,
    diagnose_checkpoints,
)
from lightning_determinism.divergence.cli import main as cli
from tests.fault_models import FaultNet
from tests.helpers import CHILD_TIMEOUT_S, child_env
from tests.lightning_models import quiet_trainer

ROOT = Path(__file__).resolve().parents[1]

# name: (FaultNet arguments, intra-op threads, expected (step, micro_batch, module, phase, cause))
FAULTS = {
    "extra random draw in training_step": ({"fault": "extra_draw"}, 1, (1, 0, None, "forward", "randomness")),
    "extra draw after the forward": ({"fault": "late_draw"}, 1, (1, 0, None, "forward", "randomness")),
    "extra python draw": ({"fault": "python_draw"}, 1, (1, 0, None, "forward", "randomness")),
    "two batches swapped": ({"fault": "swap"}, 1, (1, 0, None, "data", "data")),
    "output from outside the seeds": ({"fault": "outside"}, 1, (1, 0, "net.4", "forward", "kernel")),
    "another dropout probability": ({"p": 0.3}, 1, (0, 0, "net.3", "forward", "randomness")),
    "another learning rate": ({"lr": 0.11}, 1, (0, None, "net.0", "optimizer", "optimizer")),
    "another intra-op thread count": ({}, 2, (0, 0, "net.2", "forward", "kernel")),
}


def _fit(path, threads=1, steps=3, callbacks=(), ckpt=None, max_steps=3, **model):
    torch.set_num_threads(threads)
    probe = DivergenceProbe(path, steps=steps) if path is not None else None
    trainer = quiet_trainer(
        DeterministicSingleDeviceStrategy(seed=3, device="cpu"), 1, max_steps=max_steps,
        callbacks=[*([probe] if probe else []), *callbacks],
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
    )  # fmt: skip
    module = FaultNet(**model)
    trainer.fit(module, ckpt_path=ckpt)
    return module


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    paths = {"reference": root / "reference.json", "identical": root / "identical.json"}
    _fit(paths["reference"])
    module = _fit(paths["identical"])
    for i, (name, (kwargs, threads, _)) in enumerate(FAULTS.items()):
        paths[name] = root / f"fault{i}.json"
        _fit(paths[name], threads, **kwargs)
    return paths, module


@pytest.mark.parametrize("name", list(FAULTS))
def test_each_injected_fault_is_named(suite, name):
    paths, _ = suite
    found = diagnose(paths["reference"], paths[name])
    expected = dict(zip(("step", "micro_batch", "module", "phase", "cause"), FAULTS[name][2], strict=True))
    assert found["verdict"] == "diverged"
    assert {k: found[k] for k in expected} == expected, found["explanation"]
    # Either run may be A: the same place and cause.
    swapped = diagnose(paths[name], paths["reference"])
    assert {k: swapped[k] for k in expected} == expected


def test_identical_runs_are_the_same_and_nothing_is_left_hooked(suite):
    paths, module = suite
    found = diagnose(paths["reference"], paths["identical"])
    assert found["verdict"] == "same" and found["step"] is None and found["cause"] is None
    assert found["steps"] == [0, 1, 2] and found["compared"] > 100
    assert paths["reference"].read_bytes() != b"" and paths["reference"].stat().st_size < 64_000  # digests only
    for m in module.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
    assert all(not p._backward_hooks for p in module.parameters())


def test_the_evidence(suite):
    paths, _ = suite
    threads = diagnose(paths["reference"], paths["another intra-op thread count"])["evidence"]
    assert threads["module_type"] == "Center" and threads["ops"] == ["mean", "sub"]
    assert threads["output_a"] != threads["output_b"] and 0 < threads["norm_relative_difference"] < 1e-6
    lr = diagnose(paths["reference"], paths["another learning rate"])["evidence"]
    assert lr["hyperparameters"] == {"group 0: lr": [0.1, 0.11]} and lr["parameter"] == "net.0.weight"
    swap = diagnose(paths["reference"], paths["two batches swapped"])
    assert swap["evidence"]["a_batch_in_b"] == ["step 2, micro-batch 0"]
    draw = diagnose(paths["reference"], paths["extra random draw in training_step"])
    assert draw["evidence"]["streams"] == ["torch"] and "the entry of `net`" in draw["explanation"]


def test_the_command_exit_codes_json_and_text(suite, tmp_path, capsys):
    paths, _ = suite
    env = child_env(PYTHONPATH=str(ROOT))
    argvs = [
        [str(paths["reference"]), str(paths["another dropout probability"]), "--json"],
        [str(paths["reference"]), str(tmp_path / "missing.json")],
    ]
    runs = [
        subprocess.Popen([sys.executable, "-m", "lightning_determinism", "diagnose", *argv], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
        for argv in argvs
    ]  # fmt: skip
    (diverged, _), (_, err) = (run.communicate(timeout=CHILD_TIMEOUT_S) for run in runs)
    assert [run.returncode for run in runs] == [1, 2]
    answer = json.loads(diverged)
    assert {k: answer[k] for k in ("verdict", "step", "micro_batch", "module", "phase", "cause")} == {
        "verdict": "diverged", "step": 0, "micro_batch": 0, "module": "net.3", "phase": "forward",
        "cause": "randomness",
    }  # fmt: skip
    assert answer["evidence"]["module_type"] == "Dropout"
    assert err.splitlines() == [f"lightning-determinism: error: {tmp_path / 'missing.json'}: no such file"]
    assert cli(["diagnose", str(paths["reference"]), str(paths["identical"]), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "same"
    assert cli(["diagnose", str(paths["reference"]), str(paths["identical"])]) == 0
    assert capsys.readouterr().out.startswith("same: ")


def test_the_command_in_process(suite, capsys):
    paths, _ = suite
    assert cli(["diagnose", str(paths["reference"]), str(paths["two batches swapped"])]) == 1
    out = capsys.readouterr().out
    assert out.startswith("diverged at step 1, micro-batch 0: data phase") and "cause: data" in out


def test_bad_files_exit_2(suite, tmp_path, capsys):
    paths, _ = suite
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps({"format": 1, "world_size": 1, "steps": []}))
    data = json.loads(paths["reference"].read_text())
    later = tmp_path / "later.json"
    later.write_text(json.dumps({**data, "steps": [{**s, "step": s["step"] + 10} for s in data["steps"]]}))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**data, "parameters": {"x": ""}}))
    cases = [
        (baseline, "not a probe file (expected a DivergenceProbe JSON with 'format': 1) (a NumericalBaseline file?"),
        (later, "no step in common: A recorded [0, 1, 2], B [10, 11, 12]"),
        (other, "different parameters (another model?)"),
        (tmp_path, "is a directory, not a probe file"),
    ]
    for path, message in cases:
        assert cli(["diagnose", str(paths["reference"]), str(path)]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    with pytest.raises(ProbeFileError, match="no step in common"):
        diagnose(paths["reference"], later)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"steps": 0}, ValueError, "`steps` must be a positive int or a list of steps >= 0, got 0"),
        (
            {"steps": [1, -2]},
            ValueError,
            r"`steps` must be a positive int or a non-empty list of ints >= 0, got \[1, -2\]",
        ),
        ({"steps": "3"}, TypeError, "`steps` must be an int or a list of ints, got str"),
        ({"modules": "net"}, TypeError, "`modules` must be None or a list of module paths"),
    ],
)
def test_bad_arguments(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        DivergenceProbe(tmp_path / "p.json", **kwargs)


def test_unknown_module_names_are_refused(tmp_path):
    probe = DivergenceProbe(tmp_path / "p.json", steps=1, modules=["net.3", "net.9"])
    trainer = quiet_trainer(DeterministicSingleDeviceStrategy(seed=3, device="cpu"), 1, max_steps=1, callbacks=[probe])
    with pytest.raises(ValueError, match=r"`modules` must name modules of the model .* got unknown \['net.9'\]"):
        trainer.fit(FaultNet(width=8))


def test_a_subset_of_modules(tmp_path):
    files = []
    for p in (0.2, 0.3):
        files.append(tmp_path / f"p{p}.json")
        probe = DivergenceProbe(files[-1], steps=2, modules=["net.3"])
        trainer = quiet_trainer(
            DeterministicSingleDeviceStrategy(seed=3, device="cpu"), 1, max_steps=2, callbacks=[probe]
        )
        trainer.fit(FaultNet(p=p, width=8))
    assert json.loads(files[0].read_text())["modules"] == {"net.3": "Dropout"}
    found = diagnose(*files)
    assert (found["module"], found["cause"], found["step"]) == ("net.3", "randomness", 0)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13])
def test_bisection_finds_the_first_differing_pair_within_its_bound(tmp_path, n):
    for parted in range(n + 1):  # the first differing checkpoint's position; n: none differs
        dirs = {}
        for run in ("a", "b"):
            dirs[run] = tmp_path / f"{n}-{parted}-{run}"
            dirs[run].mkdir()
            for i in range(n):
                value = 1.0 if run == "b" and i >= parted else 0.0
                torch.save({"state_dict": {"w": torch.tensor([value])}}, dirs[run] / f"epoch=0-step={i + 1}.ckpt")
        found = bisect_checkpoints(dirs["a"], dirs["b"])
        assert found.comparisons <= math.ceil(math.log2(n)) + 1 == found.limit
        assert found.first_different == (parted + 1 if parted < n else None)
        assert found.last_equal == (parted if parted > 0 else None)


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_a_divergence_after_the_recorded_steps_is_bisected_and_diagnosed(tmp_path):
    faults = {"a": {}, "b": {"fault": "extra_draw", "fault_step": 5}}
    for run, kwargs in faults.items():
        saving = ModelCheckpoint(dirpath=tmp_path / run, every_n_train_steps=1, save_top_k=-1, filename="{step}")
        _fit(tmp_path / run / "probe.json", steps=3, callbacks=[saving], max_steps=8, width=32, **kwargs)
    recorded = diagnose(tmp_path / "a" / "probe.json", tmp_path / "b" / "probe.json")
    assert recorded["verdict"] == "same"  # the fault comes after the recorded steps

    replays = []

    def replay(run, checkpoint, probe):
        replays.append((run, checkpoint.name if checkpoint else None, probe.steps))
        _fit(None, callbacks=[probe], ckpt=checkpoint, max_steps=probe.steps[-1] + 1, width=32, **faults[run])

    found = diagnose_checkpoints(tmp_path / "a", tmp_path / "b", replay, tmp_path / "replay")
    assert {k: found[k] for k in ("verdict", "step", "micro_batch", "phase", "cause")} == {
        "verdict": "diverged", "step": 5, "micro_batch": 0, "phase": "forward", "cause": "randomness"
    }  # fmt: skip
    bisection = found["bisection"]
    assert (bisection["last_equal"], bisection["first_different"]) == (5, 6)
    assert bisection["comparisons"] <= math.ceil(math.log2(8)) + 1 == bisection["limit"]
    assert replays == [("a", "step=5.ckpt", (5,)), ("b", "step=5.ckpt", (5,))]


def test_the_example_names_the_callback_that_draws(tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("diagnose_two_runs", ROOT / "examples" / "diagnose_two_runs.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("diverged at step 2, micro-batch 0: forward phase, module -\ncause: randomness")
    assert "the entry of `embed`" in out and f"lightning-determinism diagnose {tmp_path / 'a.json'}" in out


def test_diagnose_usage_errors_answer_without_importing_torch():
    code = """
import contextlib, io, sys
import _lightning_determinism_cli as entry
codes = []
for argv in (["diagnose", "--help"], ["diagnose", "a.json"], ["diagnose", "a", "b", "--plot", "x.png"]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            codes.append(entry.main(argv))
        except SystemExit as done:
            codes.append(done.code)
print(codes, sorted(m for m in ("torch", "lightning", "lightning_determinism") if m in sys.modules))
"""
    env = child_env(PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                            timeout=CHILD_TIMEOUT_S)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[0, 2, 2] []"


def test_unwrap_finds_the_users_module_inside_fabrics_wrapper():
    import lightning as L
    from torch import nn

    from lightning_determinism.divergence.diagnosis.recorder import unwrap

    model = nn.Linear(2, 2)
    fabric = L.Fabric(accelerator="cpu", devices=1)
    wrapped = fabric.setup_module(model)
    assert wrapped is not model and unwrap(wrapped) is model
    assert unwrap(model) is model
