"""Batch-invariant evaluation on 1, 2 and 3 processes at eval batch sizes 1, 4 and 16: a GRU LM and a causal
transformer, float32 and bf16 autocast, over padded variable-length batches. With the strategies'
``batch_invariant=True`` the exact metrics and every sample's losses are the same bits on all nine layouts, and
sampling through ``sample_streams`` gives every prompt the same continuation; stock evaluation is the failing
reference."""

import json
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch.loggers import CSVLogger

import _lightning_determinism_cli as entry
from lightning_determinism import DeterministicDDPStrategy, DeterministicSingleDeviceStrategy, SampleRecord
from lightning_determinism.divergence.sample_record import compare_samples, load_samples
from lightning_determinism.seeding import isolation
from tests.helpers.eval_models import BATCH_SIZES, KINDS, EvalBench, loaders, relative
from tests.helpers.lightning_models import quiet_trainer

pytestmark = pytest.mark.distributed

WORLD_SIZES = (1, 2, 3)


def _strategy(world_size, batch_invariant):
    if world_size == 1:
        return DeterministicSingleDeviceStrategy(device="cpu", seed=7, batch_invariant=batch_invariant)
    return DeterministicDDPStrategy(seed=7, start_method="fork", batch_invariant=batch_invariant)


def _run(out, stage, world_size, batch_invariant=True):
    out.mkdir(parents=True, exist_ok=True)
    with pytest.MonkeyPatch.context() as patch:  # the first predict call of the process on every layout
        patch.setattr(isolation, "_CALLS", {})
        # One intra-op thread in every process (Lightning keeps OMP_NUM_THREADS where it is set): the probes are per
        # thread count, and a BLAS may split a reduction between threads on a machine with more cores.
        patch.setenv("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)
        logger = CSVLogger(out / f"{stage}-{world_size}", name="csv", version=0)  # the record, and SampleRecord's file
        trainer = quiet_trainer(
            _strategy(world_size, batch_invariant), devices=world_size, logger=logger,
            callbacks=[SampleRecord()] if stage == "validate" else [],
        )  # fmt: skip
        run = trainer.validate if stage == "validate" else trainer.predict
        run(EvalBench(str(out)), loaders(stage), **({"verbose": False} if stage == "validate" else {}))
    return json.loads((out / f"{stage}-{world_size}.json").read_text())


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("batch-invariant")


@pytest.fixture(scope="module")
def runs(root):
    found = {("validate", "stock"): _run(root / "stock", "validate", 1, batch_invariant=False)}
    _run(root / "stock", "validate", 2, batch_invariant=False)  # for compare: the stock layouts disagree
    for world_size in WORLD_SIZES:
        found["validate", world_size] = _run(root / "on", "validate", world_size)
    for world_size in (1, 2):
        found["predict", world_size] = _run(root / "on", "predict", world_size)
    return found


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("metric", ["ppl", "loss"])
def test_the_exact_metrics_are_the_same_bits_on_every_layout(runs, kind, metric):
    values = {
        (world_size, size): runs["validate", world_size][f"{kind}/{metric}/{size}"]
        for world_size in WORLD_SIZES
        for size in BATCH_SIZES
    }
    assert len(set(values.values())) == 1, values


@pytest.mark.parametrize("kind", KINDS)
def test_every_samples_losses_are_the_same_bits_on_every_layout(runs, kind):
    reference = runs["validate", 1]["samples"][f"{kind}/1"]
    assert len(reference) == 37
    for world_size in WORLD_SIZES:
        for size in BATCH_SIZES:
            assert runs["validate", world_size]["samples"][f"{kind}/{size}"] == reference, (world_size, size)


def test_stock_evaluation_depends_on_the_eval_batch_size(runs):
    # The failing reference: the same weights, one process, batch 1 / 4 / 16 without the mode. Kernels choose their
    # paths by shape on the CPUs measured (all four models vary there); a machine whose stock kernels happen to give
    # every layout the same bits has no failing reference to show, which is said instead of failing.
    stock = runs["validate", "stock"]
    values = {kind: [stock[f"{kind}/ppl/{size}"] for size in BATCH_SIZES] for kind in KINDS}
    varying = [kind for kind in KINDS if len(set(values[kind])) > 1]
    if not varying:
        pytest.skip("this machine's stock kernels gave eval batch 1, 4 and 16 the same bits: no failing reference")
    for kind in varying:
        samples = [stock["samples"][f"{kind}/{size}"] for size in BATCH_SIZES]
        assert any(samples[0][i] != samples[b][i] for i in samples[0] for b in (1, 2)), kind
        if kind.endswith("bf16"):  # a flipped bit is a bf16 step: far above float32's 1e-10
            assert max(relative(value, values[kind][0]) for value in values[kind]) > 1e-7, kind


@pytest.mark.parametrize("kind", KINDS)
def test_sampled_continuations_are_the_same_on_every_layout(runs, kind):
    layouts = {(w, size): runs["predict", w][f"{kind}/streams/{size}"] for w in (1, 2) for size in (1, 4)}
    reference = layouts[1, 1]
    assert len(reference) == 12
    assert all(layout == reference for layout in layouts.values()), layouts
    # The global generator (one evaluation stream per rank) gives most prompts another continuation elsewhere.
    stock = [runs["predict", w][f"{kind}/stock/{size}"] for w in (1, 2) for size in (1, 4)]
    same_everywhere = sum(all(layout[i] == stock[0][i] for layout in stock) for i in stock[0])
    assert same_everywhere < 12


def _logs(root, mode, world_size):
    return str(root / mode / f"validate-{world_size}" / "csv" / "version_0")


def test_compare_names_the_batch_composition_as_the_cause(runs, root, capsys):
    stock = [load_samples(Path(_logs(root, "stock", w), "determinism_samples_validate.json")) for w in (1, 2)]
    if not compare_samples(*stock)["differing"]:
        pytest.skip("this machine's stock kernels gave 1 and 2 processes the same bits: no batch composition to name")
    assert entry.main(["compare", _logs(root, "stock", 1), _logs(root, "stock", 2)]) == 1
    out = capsys.readouterr().out
    assert "per-sample record (validate): 111 samples in both" in out  # 37 samples x 3 eval loaders
    assert "cause: batch composition: every differing sample was evaluated in another batch" in out
    assert "batch_invariant=True" in out
    assert "world size" in out  # the records say it too
    on = yaml.safe_load(Path(_logs(root, "on", 2), "hparams.yaml").read_text())
    off = yaml.safe_load(Path(_logs(root, "stock", 2), "hparams.yaml").read_text())
    assert on["determinism/batch_invariant"] is True and "determinism/batch_invariant" not in off
    # The stock evaluation against the mode's: the mode itself is named (its tiles give other last bits).
    assert entry.main(["compare", _logs(root, "stock", 1), _logs(root, "on", 1)]) == 1
    assert "cause: batch-invariant evaluation in one run only" in capsys.readouterr().out


def test_compare_of_two_batch_invariant_layouts_finds_every_sample_equal(runs, root, capsys):
    assert entry.main(["compare", _logs(root, "on", 2), _logs(root, "on", 3)]) == 1  # the world sizes differ
    out = capsys.readouterr().out
    assert "111 samples in both\n  every sample's result is the same bits" in out
    files = [f"{_logs(root, 'on', w)}/determinism_samples_validate.json" for w in (1, 3)]
    assert entry.main(["diagnose", *files]) == 0
    assert "every sample's result is the same bits" in capsys.readouterr().out
