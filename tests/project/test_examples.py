"""The README's main job: the tiny LM trains on 2 processes (popen DDP) and reproduces its fingerprint; the same
model as a Fabric loop gives the same bits."""

import importlib.util
import math
import re
import sys
from pathlib import Path

import pytest

from tests.helpers import CHILD_TIMEOUT_S, child_env, warm

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_lm.py"
FABRIC_EXAMPLE = EXAMPLE.parent / "fabric_tiny_lm.py"
RECIPE_EXAMPLE = EXAMPLE.parent / "llm_recipe.py"


def _start(*args: str, example: Path = EXAMPLE, nested: bool = False) -> warm.Process:
    # nested: the example's own `python example.py` processes (a resume demo's two runs) are forked warm too
    return warm.start([sys.executable, str(example), *args], cwd=EXAMPLE.parent, env=child_env(), nested=nested)


def _finish(process: warm.Process, with_stderr: bool = False) -> str:
    out, err = process.communicate(timeout=CHILD_TIMEOUT_S)
    assert process.returncode == 0, out[-3000:] + err[-3000:]
    return out + (err if with_stderr else "")


def _run(*args: str, with_stderr: bool = False, example: Path = EXAMPLE, nested: bool = False) -> str:
    return _finish(_start(*args, example=example, nested=nested), with_stderr)


SMALL = ("--sentences", "250")  # a smaller corpus than the README's run: the same code, a sixth of the time
FORK = ("--start-method", "fork")  # the ranks forked, not started as new interpreters (~4.5 s of imports each)


@pytest.mark.distributed
def test_tiny_lm_gives_one_fingerprint_with_and_without_workers():
    # Two processes, and settings that must not matter: reproducible across runs, independent of the workers and of
    # how the ranks start (the README's popen ranks: the second an interpreter of its own; forked ranks).
    one_epoch = ("--epochs", "1", *SMALL)
    started = _start(*one_epoch, "--workers", "2"), _start(*one_epoch, "--workers", "0", *FORK)
    with_workers, in_process = _finish(started[0], with_stderr=True), _finish(started[1])  # side by side
    for noise in ("LeafSpec", "litlogger", "weights_only", "replicates some samples", "Traceback"):
        assert noise not in with_workers, noise
    prints = [re.findall(r"weights sha256: ([0-9a-f]{64})", out) for out in (with_workers, in_process)]
    assert len(prints[0]) == 1 and prints[0] == prints[1]
    assert "[rank: 0] lightning_determinism: base seed 42, local seed 42, debug_mode=error" in with_workers
    assert "[rank: 1] lightning_determinism: base seed 42, local seed 43, debug_mode=error" in with_workers
    pattern = r"epoch 0: val/loss (\d+\.\d+) val/ppl (\d+\.\d+)"
    figures = re.findall(pattern, with_workers)
    assert figures == re.findall(pattern, in_process) and len(figures) == 1
    loss, ppl = map(float, figures[0])
    assert abs(ppl - math.exp(loss)) < 1e-5 * ppl  # both exact per-token means over the same tokens


def _in_process(capsys, *args: str) -> str:
    """The tiny LM on one device in this process (no interpreter to start): what it prints."""
    import logging

    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import tiny_lm
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    handlers = list(logging.getLogger("lightning_determinism").handlers)
    try:
        tiny_lm.main(list(args))
    finally:
        logging.getLogger("lightning_determinism").handlers[:] = handlers  # show_seed_lines() added one
    captured = capsys.readouterr()
    return captured.out + captured.err


@pytest.mark.distributed
def test_tiny_lm_invariant_mode_gives_one_fingerprint_on_one_and_two_processes(capsys):
    two = _start("--invariant", "--devices", "2", "--epochs", "1", *SMALL, *FORK)  # meanwhile, the one-device runs here
    one = _in_process(capsys, "--invariant", "--devices", "1", "--epochs", "1", *SMALL)
    other_seed = _in_process(capsys, "--invariant", "--devices", "1", "--epochs", "1", "--seed", "1", *SMALL)
    outs = [one, _finish(two, with_stderr=True)]
    prints = [re.findall(r"weights sha256: ([0-9a-f]{64})", out) for out in outs]
    assert len(prints[0]) == 1 and prints[0] == prints[1]
    assert "B=64 samples per optimizer step in 4 micro-batches of m=16; 2 process(es) x 2 micro-batches" in outs[1]
    assert outs[1].count("world-size-invariant training:") == 1
    figures = [re.findall(r"epoch 0: val/loss (\d+\.\d+) val/ppl (\d+\.\d+)", out) for out in outs]
    assert len(figures[0]) == 1 and figures[0] == figures[1]
    # ... and the fingerprint is the seed's: another seed, another model.
    assert re.findall(r"weights sha256: ([0-9a-f]{64})", other_seed) not in ([], prints[0])


@pytest.mark.distributed
def test_model_parallel_example_prints_the_2x2_pattern(capfd, monkeypatch):
    # Its main in this process, forking the four ranks (spawned ones would import torch four times; the spawn path is
    # tested in tests/distributed); capfd: the ranks print on the file descriptor they inherit.
    spec = importlib.util.spec_from_file_location(
        "model_parallel_seeding", EXAMPLE.parent / "model_parallel_seeding.py"
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    monkeypatch.setattr(sys, "argv", ["model_parallel_seeding.py", "--start-method", "fork"])
    example.main()
    rows = re.findall(
        r"rank (\d): dp (\d) mp (\d) \| default (\w+) .*model-parallel-rng (\w+) .*'noise'\) (\w+)",
        capfd.readouterr().out,
    )
    assert [r[:3] for r in rows] == [("0", "0", "0"), ("1", "0", "1"), ("2", "1", "0"), ("3", "1", "1")]
    default = [r[3] for r in rows]
    tensor_parallel = [r[4] for r in rows]
    noise = [r[5] for r in rows]
    assert default[0] == default[1] != default[2] == default[3]
    assert tensor_parallel[0] == tensor_parallel[2] != tensor_parallel[1] == tensor_parallel[3]
    assert len(set(noise)) == 4


HAVE_LITDATA = importlib.util.find_spec("litdata") is not None


@pytest.fixture(scope="module")
def resume_demos():
    # Each demo runs an uninterrupted 2-epoch run that checkpoints on its way, then resumes that checkpoint in a new
    # process, and prints the uninterrupted run's validation lines: one pair of runs serves the resume claims and the
    # Trainer-equals-Fabric claim.
    # Both demos at once: each spends much of its time starting processes, which the other one's work fills.
    # The Trainer's ranks forked (its popen runs: test_tiny_lm_gives_one_fingerprint_with_and_without_workers); the
    # Fabric example's launch() starts popen ranks.
    trainer = _start("--resume", "--epochs", "2", *SMALL, *FORK, nested=True)
    fabric = _start("--resume", "--epochs", "2", *SMALL, example=FABRIC_EXAMPLE, nested=True)
    recipe = _start("--resume", "--epochs", "1", example=RECIPE_EXAMPLE)
    return {"trainer": _finish(trainer), "fabric": _finish(fabric), "recipe": _finish(recipe)}


@pytest.mark.distributed
def test_the_llm_recipe_resumes_mid_epoch_to_the_uninterrupted_fingerprint(resume_demos):
    # tensor parallel -> activation checkpointing -> compile -> FSDP2, bf16, clipping, on 2 processes
    out = resume_demos["recipe"]
    assert "data_parallel=0 tensor_parallel=1" in out
    prints = re.findall(r"^fingerprint ([0-9a-f]{16})$", out, re.M)
    assert len(prints) == 3 and prints[0] == prints[2] != prints[1]  # straight, stopped half-way, resumed


@pytest.mark.distributed
def test_tiny_lm_resume_demo_is_bitwise_from_the_middle_of_an_epoch(resume_demos):
    out = resume_demos["trainer"]
    prints = re.findall(r":\s+([0-9a-f]{64})", out)
    assert len(prints) == 2 and prints[0] == prints[1]
    position = re.search(r"checkpoint at step (\d+) \(epoch (\d+), batch (\d+) of (\d+)\)", out)
    assert position and 0 < int(position.group(3)) < int(position.group(4))  # in the middle of an epoch
    assert "bitwise identical" in out


@pytest.mark.distributed
def test_fabric_resume_demo_is_bitwise(resume_demos):
    out = resume_demos["fabric"]
    prints = re.findall(r":\s+([0-9a-f]{64})", out)
    assert len(prints) == 2 and prints[0] == prints[1]
    assert "saved half-way into epoch 1, resumed" in out and "bitwise identical" in out


@pytest.mark.distributed
def test_a_hand_written_fabric_loop_computes_what_the_trainer_does(resume_demos):
    # The same model, data and seed as the Trainer example: the same weights and validation figures, bit for bit.
    trainer, fabric = (
        re.findall(r"uninterrupted 2 epochs:\s+([0-9a-f]{64})", resume_demos[k]) for k in ("trainer", "fabric")
    )
    assert len(trainer) == 1 and trainer == fabric
    pattern = r"epoch (\d): val/loss (\d+\.\d+) val/ppl (\d+\.\d+)"
    figures = re.findall(pattern, resume_demos["trainer"])
    assert len(figures) == 2 and figures == re.findall(pattern, resume_demos["fabric"])


@pytest.mark.distributed
def test_compare_single_vs_ddp_example_passes(capsys, monkeypatch):
    # Its main in this process: its DDP runs fork their ranks from here (no interpreter to start).
    spec = importlib.util.spec_from_file_location("compare_single_vs_ddp", EXAMPLE.parent / "compare_single_vs_ddp.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    monkeypatch.setattr(sys, "argv", ["compare_single_vs_ddp.py"])
    assert example.main() == 0
    out = capsys.readouterr().out
    assert "2-rank DDP run matches the 1-process baseline" in out
    assert "equal within rtol=0.0001, atol=1e-06" in out


@pytest.mark.distributed
@pytest.mark.skipif(not HAVE_LITDATA, reason="needs litdata (pip install -e '.[streaming]', docs/streaming.md)")
def test_streaming_example_resumes_a_litdata_epoch_bitwise():
    # One process with 2 litdata workers (2 ranks with workers: tests/data/test_streams_dist.py).
    example = EXAMPLE.parent / "streaming_lm.py"
    out = _run("--resume", "--sentences", "400", "--devices", "1", example=example, nested=True)
    fingerprints = re.findall(r"\b[0-9a-f]{64}\b", out)
    assert len(fingerprints) == 2 and fingerprints[0] == fingerprints[1], out
    assert "checkpoint at step 9 of 16, resumed" in out and "bitwise identical" in out


def test_batch_invariant_example_gives_one_perplexity_and_one_continuation_per_prompt(capsys):
    from tests.helpers.eval_models import example

    results = example("batch_invariant_eval").main(["--sentences", "200"])
    assert len(set(results["invariant"])) == 1  # eval batch 1, 4, 16: the same bits
    by_one, by_four = results["continuations"]
    assert sorted(by_one) == list(range(8)) and by_one == by_four
    out = capsys.readouterr().out
    assert "batch_invariant=True  val/ppl at eval batch 1, 4, 16:" in out and ": the same bits" in out
