"""The ``lightning-determinism`` command driven as a user drives it: its entry points, start-up cost and messages.

The Trainer-recorded baselines and checkpoints are exercised in ``test_baseline.py``; here small files are written by
hand, so that these tests cost the command's own start-up and nothing more.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import _lightning_determinism_cli as entry
from lightning_determinism.divergence import cli, commands
from lightning_determinism.divergence.baseline_file import DEFAULT_ATOL, DEFAULT_RTOL
from lightning_determinism.seeding.rank_states import CHECKPOINT_KEY
from tests.helpers import CHILD_TIMEOUT_S, child_env, warm

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    """The child imports this checkout's code, whatever is installed."""
    return child_env(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def _baselines(tmp_path: Path) -> tuple[Path, Path]:
    steps = [
        {"step": i, "loss": loss, "grad_norm": 1.0, "grad_norms": {"w": 1.0}, "param_norms": {"w": 2.0}}
        for i, loss in enumerate([2.302585093, 1.5, 0.69314718, 0.1234])
    ]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"format": 1, "world_size": 1, "steps": steps}))
    steps[3] = {**steps[3], "loss": 12.0}
    b.write_text(json.dumps({"format": 1, "world_size": 1, "steps": steps}))
    return a, b


def test_the_console_script_is_the_light_entry_and_the_same_command():
    pyproject = (ROOT / "pyproject.toml").read_text()  # no tomllib on Python 3.10
    assert re.search(r'^lightning-determinism = "_lightning_determinism_cli:main"$', pyproject, re.M)
    assert cli.main is entry.main  # `python -m lightning_determinism` and older imports run the same function
    assert commands.PROG == entry.PROG  # written out in both: the work's error lines name the same command


def test_tolerances_shown_by_help_are_the_ones_compare_applies():
    assert float(entry._DEFAULT_TOLERANCES["rtol"]) == DEFAULT_RTOL
    assert float(entry._DEFAULT_TOLERANCES["atol"]) == DEFAULT_ATOL


def test_help_and_usage_errors_answer_without_importing_torch_or_the_package():
    code = """
import contextlib, io, sys
import _lightning_determinism_cli as entry
codes = []
for argv in (["--help"], ["compare", "--help"], ["compare", "a.json"], ["compare", "a", "b", "--rtol", "-1"], []):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            codes.append(entry.main(argv))
        except SystemExit as done:
            codes.append(done.code)
heavy = sorted(m for m in ("torch", "lightning", "numpy", "lightning_determinism") if m in sys.modules)
print(codes, heavy)
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=_env(), cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[0, 0, 2, 2, 2] []"


def test_python_dash_m_runs_the_command_with_its_exit_codes(tmp_path, capsys):
    # `python -m` on a diverged pair runs in tests/divergence/test_baseline.py's shell script (one interpreter
    # importing torch less here); this one is checked before torch is imported.
    a, b = _baselines(tmp_path)
    not_a_checkpoint = tmp_path / "x.py"
    not_a_checkpoint.write_text("print('hello')\n")
    # Forked from the warm interpreter (tests/helpers/warm.py), which imported this checkout's package as pytest did:
    # `python -m` as runpy runs it, the package's __main__ after its __init__.
    run = warm.start([sys.executable, "-m", "lightning_determinism", "report", str(not_a_checkpoint)],
                     env=child_env(), cwd=tmp_path)  # fmt: skip
    err = run.communicate(timeout=CHILD_TIMEOUT_S)[1]
    assert run.returncode == 2
    assert entry.main(["compare", str(a), str(b)]) == 1
    assert "first divergence: step 3, loss: 0.1234 vs 12.0" in capsys.readouterr().out
    # One line naming the file and what was expected, not torch's page about weights_only.
    assert err.splitlines() == [
        f"lightning-determinism: error: {not_a_checkpoint}: not a checkpoint or baseline file (expected a Lightning"
        " checkpoint (.ckpt) or a NumericalBaseline file (.json))"
    ]


def test_the_loss_columns_line_up(tmp_path, capsys):
    a, b = _baselines(tmp_path)
    assert cli.main(["compare", str(a), str(b)]) == 1
    lines = capsys.readouterr().out.splitlines()
    header, rows = lines[0], lines[1:5]
    ends = {header.index("loss A") + len("loss A"), header.index("loss B") + len("loss B")}
    for row in rows:
        losses = row.split()[1:3]
        assert {row.index(losses[0]) + len(losses[0]), row.rindex(losses[1]) + len(losses[1])} == ends, row
        assert {len(loss.split(".")[1]) for loss in losses} == {7}, row  # one precision: 9 digits for 12.0
    assert rows[3].startswith("   3       0.1234000      12.0000000  ")


def _checkpoint(tmp_path: Path, rng: dict, name: str = "last.ckpt") -> Path:
    entry_ = {"world_size": 1, "base_seed": 3, "ranks": [{"rng": rng, "digest": "", "loaders": {}}]}
    path = tmp_path / name
    torch.save({"epoch": 0, "global_step": 2, "state_dict": {}, CHECKPOINT_KEY: entry_}, path)
    return path


def test_report_shows_the_identity_of_the_run_that_wrote_the_checkpoint(tmp_path, capsys):
    path = _checkpoint(tmp_path, {"python": {}, "numpy": {}, "torch": torch.get_rng_state()})
    checkpoint = torch.load(path, weights_only=True)
    checkpoint[CHECKPOINT_KEY]["identity"] = {"base_seed": 3, "optimizer": "SGD", "optimizer.lr": 0.01}
    torch.save(checkpoint, path)
    assert cli.main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "  identity\n" in out and "    optimizer.lr  0.01\n" in out


@pytest.mark.parametrize(
    ("cuda", "listed"),
    [([], "1 rank(s): python, numpy, torch CPU"), ([torch.zeros(16, dtype=torch.uint8)] * 2, "CUDA (2 device(s))")],
)
def test_report_lists_the_random_states_the_run_had(tmp_path, capsys, cuda, listed):
    rng = {"python": {}, "numpy": {}, "torch": torch.get_rng_state(), "cuda": cuda, "tracker": {}, "generators": {}}
    assert cli.main(["report", str(_checkpoint(tmp_path, rng)), "--json"]) == 0
    rng_state = json.loads(capsys.readouterr().out)["rng_state"]
    assert listed in rng_state
    assert ("CUDA" in rng_state) == bool(cuda)


def test_report_of_a_torch_file_it_cannot_read_says_why_in_one_line(tmp_path, capsys):
    import numpy as np

    path = tmp_path / "numpy.ckpt"
    torch.save({"weights": np.zeros(2)}, path)
    assert cli.main(["report", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"{path}: a torch file that torch.load(weights_only=True) cannot read (" in err
    assert "Unsupported global" in err and "expected a Lightning checkpoint" in err


def test_a_missing_input_file_is_refused_before_torch_is_imported(tmp_path):
    missing = tmp_path / "missing.ckpt"
    code = f"""
import sys
import _lightning_determinism_cli as entry
status = entry.main(["report", {str(missing)!r}])
print(status, "torch" in sys.modules, "lightning_determinism" in sys.modules)
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=_env(), cwd=ROOT
    )
    assert result.stdout.strip() == "2 False False", result.stderr
    assert result.stderr.splitlines() == [f"lightning-determinism: error: {missing}: no such file"]


NOT_LOGS = (
    " (nor a logger's directory: no hparams.yaml, TensorBoard event file, MLflow run or W&B run file in it or below)"
)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["compare", "{a}", "{missing}"], "{missing}: no such file"),
        (["compare", "{tmp}", "{a}"], "{tmp}: is a directory, not a baseline file" + NOT_LOGS),
        (["diagnose", "{missing}", "{a}"], "{missing}: no such file"),
        (["report", "{tmp}"], "{tmp}: is a directory, not a checkpoint or baseline file" + NOT_LOGS),
        (
            ["compare", "{a}", "{a}", "--plot", "{missing}/out.png"],
            "--plot {missing}/out.png: the directory {missing} does not exist",
        ),
    ],
)
def test_the_entry_refuses_each_unusable_input_in_one_line(tmp_path, capsys, monkeypatch, argv, message):
    a, _ = _baselines(tmp_path)
    names = {"a": a, "missing": tmp_path / "missing", "tmp": tmp_path}
    monkeypatch.setattr(commands, "run", lambda args: pytest.fail("the subcommand ran"))
    assert entry.main([arg.format(**names) for arg in argv]) == 2
    assert capsys.readouterr().err.splitlines() == [f"lightning-determinism: error: {message.format(**names)}"]


def test_report_of_a_truncated_checkpoint_says_so_with_its_size(tmp_path, capsys):
    whole = _checkpoint(tmp_path, {"torch": torch.get_rng_state()})
    cut = tmp_path / "cut.ckpt"
    data = whole.read_bytes()
    cut.write_bytes(data[: len(data) // 2])  # what a save killed half-way leaves
    assert cli.main(["report", str(cut)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"lightning-determinism: error: {cut}: a damaged or truncated checkpoint ({len(data) // 2} bytes; torch.load:"
        " PytorchStreamReader failed reading zip archive: failed finding central directory)"
    ]


def test_report_of_a_truncated_legacy_format_checkpoint_says_so(tmp_path, capsys):
    whole = tmp_path / "legacy.ckpt"
    torch.save({"epoch": 0, "state_dict": {"w": torch.zeros(64)}}, whole, _use_new_zipfile_serialization=False)
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(whole.read_bytes()[:40])
    assert cli.main(["report", str(cut)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"lightning-determinism: error: {cut}: a damaged or truncated checkpoint (40 bytes; ")


def test_report_reads_a_distributed_checkpoint_directory(tmp_path, capsys):
    # Lightning's ModelParallelStrategy / FSDP checkpoint: a directory of shards beside rank 0's meta.pt.
    import warnings

    import torch.distributed.checkpoint as dcp

    directory = tmp_path / "step=5.ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process": it is
        dcp.save({"state_dict": {"w": torch.ones(3)}}, checkpoint_id=directory, no_dist=True)
    rng = {"python": {}, "numpy": {}, "torch": torch.get_rng_state(), "cuda": [], "tracker": {}, "generators": {}}
    _checkpoint(directory, rng, name="meta.pt")
    assert entry.main(["report", str(directory), "--json"]) == 0
    described = json.loads(capsys.readouterr().out)
    assert described["kind"].startswith("Lightning distributed checkpoint") and described["shard_files"] == 1
    assert described["global_step"] == 2 and "1 rank(s): python, numpy, torch CPU" in described["rng_state"]
    (directory / "meta.pt").unlink()
    assert entry.main(["report", str(directory)]) == 2
    assert "is a directory, not a checkpoint or baseline file" in capsys.readouterr().err


def test_version_answers_without_importing_the_package(capsys):
    with pytest.raises(SystemExit) as exit_info:
        entry.main(["--version"])
    assert exit_info.value.code == 0
    import lightning_determinism

    assert capsys.readouterr().out.strip() == f"lightning-determinism {lightning_determinism.__version__}"


@pytest.mark.parametrize("kind", ["zip", "legacy", "distributed"])
def test_compare_given_checkpoints_points_to_report(tmp_path, capsys, kind):
    paths = []
    for name in ("a.ckpt", "b.ckpt"):
        path = tmp_path / name
        if kind == "distributed":  # a DCP directory as Lightning's distributed save leaves it
            path.mkdir()
            (path / ".metadata").write_bytes(b"\x80\x04metadata")
        else:
            torch.save({"state_dict": {}, "global_step": 3}, path, _use_new_zipfile_serialization=kind == "zip")
        paths.append(str(path))
    assert entry.main(["compare", *paths]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "a checkpoint, not a NumericalBaseline file" in err[0]
    assert f"lightning-determinism report {paths[0]}" in err[0]
    assert "utf-8" not in err[0] and "Traceback" not in err[0]


def test_compare_given_a_probe_file_points_to_diagnose(tmp_path, capsys):
    a, _ = _baselines(tmp_path)
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps({"format": 1, "kind": "divergence-probe", "steps": []}))
    assert entry.main(["compare", str(a), str(probe)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a DivergenceProbe file, not a NumericalBaseline one" in err[0]
    assert "`lightning-determinism diagnose A B` reads probe files" in err[0]


def test_the_relative_spread_leaves_out_what_atol_excuses():
    from lightning_determinism.divergence.baseline_file import compare_baselines

    def step(loss, zero_grad):
        return {"step": 0, "loss": loss, "grad_norm": 1.0, "grad_norms": {"w": 1.0, "z": zero_grad},
                "param_norms": {"w": 2.0, "z": 1.0}}  # fmt: skip

    a, b = {"steps": [step(1.0, 1e-9)]}, {"steps": [step(1.00002, 3e-9)]}  # "z": 0 up to rounding on both
    out = compare_baselines(a, b, rtol=1e-4, atol=1e-6)
    assert out["first"] is None
    assert out["rows"][0]["max_rel"] == pytest.approx(2e-5, rel=1e-3)  # the loss's, not z's 0.67
    assert out["rows"][0]["max_rel_grad_norms"] == 0.0
    assert out["rows"][0]["max_abs"] == pytest.approx(2e-5, rel=1e-3)
    strict = compare_baselines(a, b, rtol=1e-4, atol=0.0)  # nothing excused: z counts, and diverges
    assert strict["rows"][0]["max_rel"] == pytest.approx(2 / 3) and strict["first"]["name"] == "grad_norms[z]"
