"""Baselines across parallelisms: one process, DDP, FSDP2 and tensor parallel agree within the default tolerance
(whole-tensor norms, not each rank's shard), and injected faults are found at their step and parameter.

The runs are examples/compare_parallelisms.py's own (its main: forked gloo ranks, 8 steps each), shared by every test
here.
"""

import contextlib
import importlib.util
import io
import json
import math
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn

from lightning_determinism import BaselineRecorder
from lightning_determinism.divergence.baseline_file import DEFAULT_ATOL, DEFAULT_RTOL, load_baseline
from lightning_determinism.divergence.baseline_runs import compare_runs
from lightning_determinism.divergence.cli import main as cli
from tests.helpers import run_distributed

pytestmark = pytest.mark.distributed
ON_TORCH_2_8 = torch.__version__.startswith("2.8.")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "compare_parallelisms.py"
STEPS = 8
COMM_EVERY = 5  # the example's: steps 1 and 6 profiled


def _example():
    spec = importlib.util.spec_from_file_location("compare_parallelisms", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("compare_parallelisms", module)
    spec.loader.exec_module(module)
    return module


class LearningRateFault(L.Callback):
    """Another learning rate from step ``step`` on."""

    def __init__(self, step: int, factor: float) -> None:
        self.step, self.factor = step, factor

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            for group in trainer.optimizers[0].param_groups:
                group["lr"] *= self.factor


class SkippedAllReduce(L.Callback):
    """One parameter's gradient on one rank is not the all-reduced one at step ``step`` (here: zero)."""

    def __init__(self, step: int, name: str, rank: int) -> None:
        self.step, self.name, self.rank = step, name, rank

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            dict(pl_module.named_parameters())[self.name].grad.zero_()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    example = _example()
    root = tmp_path_factory.mktemp("parallelisms")
    plot, printed = root / "example.png", io.StringIO()
    with contextlib.redirect_stdout(printed):  # the example itself: its four runs, its table and its plot
        status = example.main(["--steps", str(STEPS), "--out", str(root), "--plot", str(plot)])
    assert status == 0, printed.getvalue()
    assert "all 3 runs within rtol=0.0001, atol=1e-06 of one.json" in printed.getvalue()
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    paths = {name: root / f"{name}.json" for name in ("one", "ddp2", "fsdp2", "tp2")}
    paths["lr"] = example.record("one", root / "lr.json", steps=STEPS, callbacks=[LearningRateFault(4, 2.0)])
    fault = SkippedAllReduce(3, "model.up.bias", rank=1)
    paths["skip"] = example.record("ddp2", root / "skip.json", steps=STEPS, callbacks=[fault])
    # The example's --four run, FSDP2 x tensor parallel on 2 x 2 forked processes (without --four's other runs).
    assert "fsdp2xtp2" in example.RUNS and example.RUNS["fsdp2xtp2"][:3] == (4, 2, 2)
    paths["fsdp2xtp2"] = example.record("fsdp2xtp2", root / "fsdp2xtp2.json", steps=STEPS)
    return paths


def test_every_parallelism_stays_within_the_default_tolerance_of_one_process(runs, capsys):
    files = [str(runs[name]) for name in ("one", "ddp2", "fsdp2", "tp2")]
    table = compare_runs([(f, load_baseline(f)) for f in files], DEFAULT_RTOL, DEFAULT_ATOL)
    assert [row["verdict"] for row in table["runs"]] == ["reference"] + ["within tolerance"] * 3
    assert all(row["max_rel"] < 1e-5 for row in table["runs"])  # measured: about 2e-7
    # Each rank's shard norm was 0.0328 against the whole gradient's 0.0446 (the false divergence at step 0).
    one, fsdp2 = (load_baseline(runs[name])["steps"][0]["grad_norms"] for name in ("one", "fsdp2"))
    assert math.isclose(one["model.down.bias"], fsdp2["model.down.bias"], rel_tol=1e-6)
    assert set(one) == set(fsdp2)
    assert cli(["compare", *files]) == 0
    out = capsys.readouterr().out
    assert out.count("within tolerance (max rel") == 3 and "peak memory" in out and "comm/step" in out
    assert "all 3 runs within rtol=0.0001, atol=1e-06" in out
    assert cli(["compare", *files, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["runs"]
    assert [r["verdict"] for r in rows[1:]] == ["within tolerance"] * 3
    assert all(r["peak_memory_bytes"] > 0 and r["comm_steps"] == 2 for r in rows)


def test_fsdp2_by_tensor_parallel_on_four_processes_stays_within_the_default_tolerance(runs):
    files = [str(runs[name]) for name in ("one", "fsdp2xtp2")]
    table = compare_runs([(f, load_baseline(f)) for f in files], DEFAULT_RTOL, DEFAULT_ATOL)
    assert [row["verdict"] for row in table["runs"]] == ["reference", "within tolerance"]
    assert table["runs"][1]["max_rel"] < 1e-5
    four = load_baseline(runs["fsdp2xtp2"])
    assert four["world_size"] == 4 and len(four["steps"]) == STEPS
    one = load_baseline(runs["one"])["steps"][0]
    assert set(four["steps"][0]["grad_norms"]) == set(one["grad_norms"])  # whole tensors, every parameter


def test_the_run_and_its_costs_are_recorded(runs):
    data = load_baseline(runs["fsdp2"])
    run = data["run"]
    assert run["mesh"] == {"shape": [2, 1], "dim_names": ["data_parallel", "tensor_parallel"]}
    assert run["world_size"] == 2 and run["seed"] == 7 and run["precision"] == "32-true"
    assert run["strategy"] == "DeterministicModelParallelStrategy" and "(fork)" in run["launcher"]
    assert run["batch_shape"] == [[4, 17]] and run["device"] == "cpu" and run["torch"] == torch.__version__
    assert run["memory"] == "cpu_peak_rss_of_process" and run["comm_profiled_every"] == COMM_EVERY
    for name in ("ddp2", "fsdp2", "tp2"):
        for step in load_baseline(runs[name])["steps"]:
            assert len(step["peak_memory_bytes"]) == 2 and all(v > 0 for v in step["peak_memory_bytes"])
            if step["step"] % COMM_EVERY == 1:
                seconds = step["comm_seconds"]
                assert len(seconds) == 2 and all(v is not None and v >= 0 for v in seconds), (name, seconds)
                # torch 2.8: DDP's bucket all-reduce over gloo, asynchronous, was seen once (1 CI run in 4) to end
                # outside the profiled window on both ranks (0.0); FSDP2's and tensor parallel's are waited for inside
                if name != "ddp2" or not ON_TORCH_2_8:
                    assert all(v > 0 for v in seconds), (name, seconds)
            else:
                assert step["comm_seconds"] == [None, None]
    assert load_baseline(runs["tp2"])["run"]["mesh"]["shape"] == [1, 2]
    ddp2 = load_baseline(runs["ddp2"])["run"]
    assert ddp2["strategy"] == "DeterministicDDPStrategy" and "(fork)" in ddp2["launcher"] and ddp2["mesh"] is None


def test_another_learning_rate_is_reported_at_its_step(runs, capsys):
    table = compare_runs([(n, load_baseline(runs[n])) for n in ("one", "lr")], DEFAULT_RTOL, DEFAULT_ATOL)
    first = table["runs"][1]["first"]
    assert first["step"] == 4 and first["name"].startswith("param_norms[")  # the gradients of step 4 still agree
    assert cli(["compare", str(runs["one"]), str(runs["fsdp2"]), str(runs["lr"])]) == 1
    out = capsys.readouterr().out
    assert "step 4, param_norms[" in out and "1 of 2 runs diverge" in out


def test_a_skipped_all_reduce_is_reported_at_its_step_parameter_and_rank(runs, capsys):
    table = compare_runs([(n, load_baseline(runs[n])) for n in ("one", "skip")], DEFAULT_RTOL, DEFAULT_ATOL)
    first = table["runs"][1]["first"]
    assert (first["step"], first["name"], first["b"]) == (3, "grad_norms[model.up.bias] on rank 1", 0.0)
    by_rank = load_baseline(runs["skip"])["steps"][3]["by_rank"]
    assert by_rank["grad_norms[model.up.bias]"][1] == 0.0 and by_rank["grad_norms[model.up.bias]"][0] > 0
    assert all("by_rank" not in step for step in load_baseline(runs["skip"])["steps"][:3])
    plot = runs["one"].parent / "runs.png"
    assert cli(["compare", str(runs["one"]), str(runs["ddp2"]), str(runs["skip"]), "--plot", str(plot)]) == 1
    assert "step 3, grad_norms[model.up.bias] on rank 1: " in capsys.readouterr().out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_figure_of_several_runs_marks_each_divergence(runs):
    from lightning_determinism.divergence._compare_plot import make_runs_figure

    names = ("one", "ddp2", "lr")
    table = compare_runs([(n, load_baseline(runs[n])) for n in names], DEFAULT_RTOL, DEFAULT_ATOL)
    fig = make_runs_figure(table, table["comparisons"])
    loss_ax, diff_ax = fig.axes
    curves = [line.get_label() for line in loss_ax.lines if not line.get_label().startswith("_")]
    assert curves == ["one (reference)", "ddp2", "lr"]
    labels = [line.get_label() for line in diff_ax.lines]
    assert "the tolerance: rtol = 0.0001, atol = 1e-06" in labels
    assert any(s.startswith("lr: diverges at step 4, param_norms[") for s in labels)
    # The lr fault is told from the healthy run: it crosses the tolerance at its first divergent step (the plot draws
    # every quantity, not only the gradient norms, which still agree at step 4); the healthy run stays below it.
    lines = {line.get_label().split(":")[0]: line for line in diff_ax.lines}
    healthy, faulty = (dict(zip(*lines[name].get_data(), strict=True)) for name in ("ddp2", "lr"))
    assert max(healthy.values()) < 1 < faulty[4] and max(v for step, v in faulty.items() if step < 4) < 1


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))


def _loop(model, recorder, x, y):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the parameters stay the start's: digests comparable
    for _ in range(2):
        recorder.begin_step(model)  # the step's memory and communication are measured from here
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        recorder.before_optimizer_step(model)
        optimizer.step()
        optimizer.zero_grad()
        recorder.after_optimizer_step(model, loss)
    recorder.finish()


def _fsdp2_loop(rank, world_size, path, x, y):
    from torch.distributed._composable.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_determinism.parallel.fsdp2_versions import average_over_gloo

    model = _model()
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,), mesh_dim_names=("data_parallel",)))
    average_over_gloo(model)  # torch 2.8's FSDP2 sums over gloo (the strategies do this themselves)
    recorder = BaselineRecorder(path, steps=2, comm_every=1)
    recorder.set_run(strategy="fully_shard by hand")
    _loop(model, recorder, x[rank::world_size], y[rank::world_size])


def test_the_recorder_in_a_loop_records_the_whole_tensors_of_an_fsdp2_model(tmp_path):
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
    _loop(_model(), BaselineRecorder(tmp_path / "one.json", steps=2), x, y)
    run_distributed(_fsdp2_loop, tmp_path, str(tmp_path / "fsdp2.json"), x, y)
    one, fsdp2 = load_baseline(tmp_path / "one.json"), load_baseline(tmp_path / "fsdp2.json")
    for a, b in zip(one["steps"], fsdp2["steps"], strict=True):
        assert a["param_digests"] == b["param_digests"]  # the one-process digests, computed shard by shard
        for group, rel_tol in (("grad_norms", 1e-6), ("param_norms", 1e-12)):  # float32 gradients summed apart
            assert a[group].keys() == b[group].keys()
            assert all(math.isclose(a[group][k], b[group][k], rel_tol=rel_tol) for k in a[group]), group
    assert fsdp2["run"]["mesh"] == {"shape": [2], "dim_names": ["data_parallel"]}
    assert fsdp2["run"]["strategy"] == "fully_shard by hand"
    assert all(v > 0 for step in fsdp2["steps"] for v in step["comm_seconds"])


class _CountedCollectives:
    """Counts the ``torch.distributed`` collectives called while it is active (those the recorder may use)."""

    NAMES = ("all_gather", "all_reduce", "broadcast", "all_gather_object", "gather")

    def __init__(self, monkeypatch_like):
        self.calls, self.active, self._set = [], False, monkeypatch_like
        for name in self.NAMES:
            original = getattr(torch.distributed, name)
            self._set(name, self._counted(name, original))

    def _counted(self, name, original):
        def counted(*args, **kwargs):
            if self.active:
                self.calls.append(name)
            return original(*args, **kwargs)

        return counted


def _counted_fsdp2_loop(rank, world_size, path, mode, x, y):
    from torch.distributed._composable.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh

    model = _model()
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,), mesh_dim_names=("data_parallel",)))
    counter = _CountedCollectives(lambda name, fn: setattr(torch.distributed, name, fn))
    recorder = BaselineRecorder(path, steps=3, mode=mode, comm_every=0)
    per_step, optimizer = [], torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        nn.functional.mse_loss(model(x[rank::world_size]), y[rank::world_size]).backward()
        counter.active = True  # only the recorder's calls: FSDP2's own collectives run outside these windows
        recorder.before_optimizer_step(model)
        counter.active = False
        optimizer.step()
        optimizer.zero_grad()
        counter.active = True
        recorder.after_optimizer_step(model, torch.tensor(1.0))
        counter.active = False
        per_step.append(len(counter.calls))
    counter.active = True
    recorder.finish()
    counter.active = False
    (Path(path).parent / f"calls-{mode}-{rank}.json").write_text(json.dumps([per_step, counter.calls]))


def test_record_mode_communicates_once_at_the_end_compare_mode_once_a_step(tmp_path):
    # Record mode keeps each step's parts (norm and digest sums of the shards, the loss, the replicas' values) and
    # completes every step with one all_gather when it writes the file (after its last step; finish() then has
    # nothing left to do); compare mode needs each step at once.
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
    path = tmp_path / "fsdp2.json"
    run_distributed(_counted_fsdp2_loop, tmp_path, str(path), "record", x, y)
    run_distributed(_counted_fsdp2_loop, tmp_path, str(path), "compare", x, y)  # against that record: it matches
    for rank in (0, 1):
        per_step, calls = json.loads((tmp_path / f"calls-record-{rank}.json").read_text())
        assert per_step == [0, 0, 1] and calls == ["all_gather"], (rank, per_step, calls)  # the last step writes
        per_step, calls = json.loads((tmp_path / f"calls-compare-{rank}.json").read_text())
        assert per_step == [1, 2, 3] and calls == ["all_gather"] * 3, (rank, per_step, calls)
    data = load_baseline(path)
    assert len(data["steps"]) == 3 and all(len(s["param_digests"]) == 4 for s in data["steps"])
    assert all(v is not None for s in data["steps"] for group in ("grad_norms", "param_norms")
               for v in s[group].values())  # fmt: skip


def _profiled_window(rank, world_size, out):
    import time

    from torch.profiler import profile

    from lightning_determinism._compat.profiler import start_scope_profiler, stop_scope_profiler
    from lightning_determinism.divergence.step_costs import StepCosts

    big, a = torch.ones(1 << 20), torch.randn(256, 256)
    costs = StepCosts(every=1)
    begin = time.perf_counter()
    costs.begin(1)
    for _ in range(3):
        a = a @ a / 256
        torch.distributed.all_reduce(big)
    costs.pause()
    wall = time.perf_counter() - begin
    costs.end()
    start_scope_profiler()  # what the step's profiler records: the backend's spans, not the operators
    torch.mm(a, a)
    torch.distributed.all_reduce(big)
    names = [name for name, _, _ in stop_scope_profiler()]
    with profile() as user:  # a profiler of the user's own: left running, the nested step unmeasured
        nested = StepCosts(every=1)
        nested.begin(1)
        torch.distributed.all_reduce(big)
        nested.pause()
        nested.end()
        torch.mm(a, a)
    result = {"seconds": costs.steps[0][1], "wall": wall, "names": names, "nested": nested.steps[0][1],
              "user_saw_mm_after": any(e.name == "aten::mm" for e in user.events())}  # fmt: skip
    Path(out, f"window-{rank}.json").write_text(json.dumps(result))


def test_a_profiled_step_sums_the_backends_spans_without_recording_operators(tmp_path):
    run_distributed(_profiled_window, tmp_path, str(tmp_path))
    for rank in (0, 1):
        found = json.loads((tmp_path / f"window-{rank}.json").read_text())
        assert 0 < found["seconds"] <= found["wall"], found  # three blocking all_reduces inside the window
        assert "gloo:all_reduce" in found["names"] and not any(n.startswith("aten::") for n in found["names"])
        assert found["nested"] is None and found["user_saw_mm_after"], found
