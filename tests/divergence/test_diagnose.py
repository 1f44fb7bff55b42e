"""The divergence probe and `diagnose` on pairs of runs with one known fault each; the checkpoint bisection.

Every fault pair is a 3-step single-process fit of ``FaultNet`` against one shared reference run. The fault suite's
score in docs/diagnose.md is this table; the distributed pairs (reduction, invariant mode on 1 and 2 processes) are in
``tests/divergence/test_diagnose_dist.py``.
"""

import json
import math
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_determinism import (
    DamagedCheckpointError,
    DeterministicSingleDeviceStrategy,
    DivergenceProbe,
    ProbeFileError,
    bisect_checkpoints,
    diagnose,
    diagnose_checkpoints,
)
from lightning_determinism.checkpoints.distributed import load_distributed_checkpoint
from lightning_determinism.divergence.cli import main as cli
from lightning_determinism.seeding.rank_states import CHECKPOINT_KEY
from tests.helpers import CHILD_TIMEOUT_S, child_env
from tests.helpers.fault_models import FaultNet
from tests.helpers.lightning_models import quiet_trainer

ROOT = Path(__file__).resolve().parents[2]

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
    # The command's own entry (what the console script and `python -m` run; both start an interpreter in
    # tests/divergence/test_cli.py and tests/divergence/test_baseline.py), here in this process.
    import _lightning_determinism_cli as entry

    codes = [entry.main(["diagnose", str(paths["reference"]), str(paths["another dropout probability"]), "--json"])]
    diverged = capsys.readouterr().out
    codes.append(entry.main(["diagnose", str(paths["reference"]), str(tmp_path / "missing.json")]))
    err = capsys.readouterr().err
    assert codes == [1, 2]
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
        (baseline, "not a probe file (expected a DivergenceProbe JSON with 'format': 2) (a NumericalBaseline file?"),
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


def _distributed_checkpoint(path, step, weight, rank1_rng=None):
    """A directory as Lightning's ModelParallelStrategy saves it: the weights and the optimizer's state (keyed by
    parameter name, as get_optimizer_state_dict gives it) in the DCP shards, the rest of the checkpoint (loops,
    callbacks, schedulers, every rank's RNG states) in rank 0's meta.pt, written last."""
    import torch.distributed.checkpoint as dcp

    state = {
        "state_dict": {"net.weight": weight, "net.bias": torch.zeros(3)},
        "optimizer_0": {
            "state": {"net.weight": {"step": torch.tensor(float(step)), "exp_avg": weight / 2}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": ["net.weight", "net.bias"]}],
        },
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process": it is
        dcp.save(state, checkpoint_id=path, no_dist=True)
    rng = [{"torch": torch.Generator().manual_seed(rank).get_state()} for rank in (0, 1)]
    ranks = [{"rng": state, "digest": "", "loaders": {}} for state in rng]
    if rank1_rng is not None:
        ranks[1]["rng"]["torch"] = rank1_rng
    torch.save({"epoch": 0, "global_step": step, "pytorch-lightning_version": "2.6.6",
                "loops": {"fit_loop": {"epoch_progress": {"current": {"completed": 0}}}}, "callbacks": {},
                "lr_schedulers": [], CHECKPOINT_KEY: {"world_size": 2, "base_seed": 3, "global_step": step,
                                                      "ranks": ranks}}, path / "meta.pt")  # fmt: skip
    return path


def _distributed_runs(tmp_path, steps, parted, what):
    """Runs "a" and "b" of `steps` distributed checkpoints each, "b" differing in `what` from step `parted` on."""
    dirs = {}
    for run in ("a", "b"):
        dirs[run] = tmp_path / run
        dirs[run].mkdir()
        for step in range(1, steps + 1):
            differs = run == "b" and parted is not None and step >= parted
            weight = torch.arange(6.0).reshape(2, 3) + (1.0 if differs and what == "weight" else 0.0)
            rng = torch.Generator().manual_seed(7).get_state() if differs and what == "rng" else None
            _distributed_checkpoint(dirs[run] / f"step={step}.ckpt", step, weight, rank1_rng=rng)
    return dirs


@pytest.mark.parametrize(
    ("what", "differences"),
    [("weight", ["optimizer_states.0.state.net.weight.exp_avg", "state_dict.net.weight"]), ("rng", ["rng.1.torch"])],
)
def test_distributed_checkpoints_are_bisected_to_the_first_differing_step_and_entry(tmp_path, what, differences):
    dirs = _distributed_runs(tmp_path, 4, parted=3, what=what)
    found = bisect_checkpoints(dirs["a"], dirs["b"])
    assert (found.last_equal, found.first_different, found.differences) == (2, 3, differences)
    assert found.checkpoints == {"a": dirs["a"] / "step=2.ckpt", "b": dirs["b"] / "step=2.ckpt"}
    assert found.comparisons <= found.limit


def test_equal_distributed_checkpoints_are_the_same_without_a_replay(tmp_path):
    dirs = _distributed_runs(tmp_path, 3, parted=None, what=None)
    found = bisect_checkpoints(dirs["a"], dirs["b"])
    assert (found.last_equal, found.first_different, found.differences, found.comparisons) == (3, None, [], 1)

    def replay(run, checkpoint, probe):
        raise AssertionError("no replay when every pair is equal")

    assert diagnose_checkpoints(dirs["a"], dirs["b"], replay, tmp_path / "replay")["verdict"] == "same"


def test_diagnose_replays_from_the_last_equal_distributed_checkpoint_directory(tmp_path):
    dirs = _distributed_runs(tmp_path, 4, parted=4, what="weight")
    replays = []

    class Replayed(Exception):
        pass

    def replay(run, checkpoint, probe):  # what a Trainer(strategy=ModelParallelStrategy(...)) resumes from
        replays.append((run, checkpoint, probe.steps))
        raise Replayed

    with pytest.raises(Replayed):
        diagnose_checkpoints(dirs["a"], dirs["b"], replay, tmp_path / "replay")
    assert replays == [("a", dirs["a"] / "step=3.ckpt", (3,))]


def test_a_distributed_checkpoint_reads_as_the_full_checkpoint(tmp_path):
    weight = torch.arange(6.0).reshape(2, 3)
    checkpoint = load_distributed_checkpoint(_distributed_checkpoint(tmp_path / "step=2.ckpt", 2, weight))
    assert torch.equal(checkpoint["state_dict"]["net.weight"], weight) and checkpoint["global_step"] == 2
    (optimizer,) = checkpoint["optimizer_states"]
    assert optimizer["param_groups"] == [{"lr": 0.1, "betas": (0.9, 0.999), "params": ["net.weight", "net.bias"]}]
    assert torch.equal(optimizer["state"]["net.weight"]["exp_avg"], weight / 2)
    assert sorted(checkpoint) == ["callbacks", "epoch", "global_step", CHECKPOINT_KEY, "loops", "lr_schedulers",
                                  "optimizer_states", "pytorch-lightning_version", "state_dict"]  # fmt: skip


def _cut_shard(path):
    shard = path / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (
            lambda p: (p / "meta.pt").unlink(),
            r"a damaged distributed checkpoint: no meta.pt \(Lightning's rank 0 writes",
        ),
        (lambda p: (p / ".metadata").unlink(), r"a damaged distributed checkpoint: no .metadata \(torch.distributed"),
        (lambda p: (p / "__0_0.distcp").unlink(), r"the shard file __0_0.distcp that .metadata names is missing"),
        (_cut_shard, r"the shard file __0_0.distcp is cut short \(100 bytes, its index needs \d+\)"),
        (
            lambda p: (p / "meta.pt").write_bytes(b"PK\x03\x04" + bytes(60)),
            r"meta.pt: a damaged or truncated checkpoint",
        ),
        (lambda p: (p / ".metadata").write_bytes(b"junk"), r"its index .metadata cannot be read \(UnpicklingError"),
    ],
    ids=["no meta.pt", "no .metadata", "a shard missing", "a shard cut short", "meta.pt damaged", ".metadata damaged"],
)
def test_a_damaged_distributed_checkpoint_is_named_with_what_is_wrong(tmp_path, damage, match):
    dirs = _distributed_runs(tmp_path, 2, parted=None, what=None)
    damage(dirs["b"] / "step=2.ckpt")
    with pytest.raises(DamagedCheckpointError, match=rf"^{re.escape(str(dirs['b'] / 'step=2.ckpt'))}.*{match}"):
        bisect_checkpoints(dirs["a"], dirs["b"])


def test_a_type_weights_only_refuses_in_the_shards_is_no_damage_and_named(tmp_path):
    import datetime
    import pickle

    import torch.distributed.checkpoint as dcp

    path = tmp_path / "step=1.ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"optimizer_0": {"param_groups": [{"since": datetime.date(2020, 1, 1)}]}}, checkpoint_id=path,
                 no_dist=True)  # fmt: skip
    torch.save({"global_step": 1}, path / "meta.pt")
    with pytest.raises(pickle.UnpicklingError, match=rf"^{re.escape(str(path))}: .* refuses an entry .*datetime.date"):
        load_distributed_checkpoint(path)


def test_a_file_against_a_distributed_directory_is_refused_naming_both(tmp_path):
    dirs = _distributed_runs(tmp_path, 1, parted=None, what=None)
    (tmp_path / "files").mkdir()
    torch.save({"state_dict": {"net.weight": torch.zeros(2, 3)}}, tmp_path / "files" / "step=1.ckpt")
    pattern = (
        rf"`{re.escape(str(dirs['a'] / 'step=1.ckpt'))}` is a distributed checkpoint directory and"
        rf" `{re.escape(str(tmp_path / 'files' / 'step=1.ckpt'))}` a single-file checkpoint: .* compares checkpoints"
        " of one kind"
    )
    with pytest.raises(ValueError, match=pattern):
        bisect_checkpoints(dirs["a"], tmp_path / "files")


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
