"""The perplexity's C kernel against independent float64 references: values, bias, non-finite rows, fallbacks."""

import math

import pytest
import torch
import torch.nn.functional as F

from lightning_determinism import DeterminismWarning
from lightning_determinism.metrics import _native, _nll
from lightning_determinism.metrics._nll import NATIVE_ENV, token_nll
from tests.helpers import require_compiled_kernel


@pytest.fixture(autouse=True)
def native(monkeypatch):
    monkeypatch.setenv(NATIVE_ENV, "1")
    token_nll(torch.zeros(1, 4), torch.zeros(1, dtype=torch.long), compiled=True)  # built once per process
    require_compiled_kernel()


def reference(logits, ids):
    return F.cross_entropy(logits.double(), ids, reduction="none")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("vocab", [4096, 4099, 5003])  # whole vectors of 16, and with tails (smaller: float64 exps)
def test_each_token_matches_float64(dtype, vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(37, vocab, generator=gen) * 4).to(dtype)
    ids = torch.randint(vocab, (37,), generator=gen)
    got = token_nll(logits, ids, compiled=True)
    assert _nll.KERNEL.native.lib is not None
    # Each exponential within ~1e-7 relative, the row sum in float64: 1e-6 leaves margin.
    torch.testing.assert_close(got, reference(logits, ids), rtol=1e-6, atol=1e-9)


def test_no_bias_where_logits_sit_on_a_coarse_grid():
    # Logits near 10 sit on float32's grid of 2**-20, so x - max are multiples of it: rounding the reduced argument
    # r = d - k ln2 once to float32 then gives every d with the same k the same rounding error, and the row sums a
    # bias (measured: -5e-10 relative with that rounding, 3e-11 with the error carried on). Random errors average
    # out over 40,000 rows of 64 (spread ~1e-12), a bias does not.
    gen = torch.Generator().manual_seed(0)
    logits = 10 + torch.randn(40_000, 64, generator=gen) * 3
    ids = torch.randint(64, (40_000,), generator=gen)
    error = token_nll(logits, ids, compiled=True) - reference(logits, ids)
    assert abs(float(error.mean())) < 1.5e-10


def test_a_peaked_row_keeps_its_tiny_terms_and_a_large_gap_stays_finite():
    logits = torch.full((2, 4096), -30.0)
    logits[0, 0] = 0.0  # the sum is 1 + 4095 * exp(-30): float32 accumulation would drop every tiny term
    logits[1, 0] = 150.0  # the target 180 nats below the max: softmax().log() would say inf
    ids = torch.tensor([0, 1])
    got = token_nll(logits, ids, compiled=True)
    expected = reference(logits, ids)
    assert math.isfinite(float(got[1]))
    # Row 0's NLL is log(1 + 3.8e-10): float32 accumulation would give 0. Each term is held to 2**-52, the 4,095
    # equal ones round alike: within 4095 * 2**-53 = 4.5e-13 (measured 3.4e-13), 1e-3 of the tiny terms' sum.
    assert float(got[0]) > 0
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=5e-13)


def test_non_finite_rows_get_the_eager_paths_kind_of_value():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 300, generator=gen)
    logits[0, 5] = float("nan")
    logits[1, 7] = float("inf")
    logits[2] = float("-inf")  # every logit -inf
    logits[3, 2] = float("-inf")  # the target's logit -inf: NLL +inf
    logits[4, 9] = float("-inf")  # another logit -inf: finite
    ids = torch.tensor([0, 0, 0, 2, 3, 4])
    got = token_nll(logits, ids, compiled=True)
    eager = token_nll(logits, ids, compiled=False)
    assert torch.equal(got.isnan(), eager.isnan()) and torch.equal(got.isinf(), eager.isinf())
    assert got.isnan().tolist() == [True, True, True, False, False, False]
    assert got[3] == math.inf
    torch.testing.assert_close(got[4:], reference(logits, ids)[4:], rtol=1e-6, atol=0)


def test_ids_outside_the_vocabulary_are_refused_before_the_c_code_reads_them():
    with pytest.raises(ValueError, match=r"`ids` must lie in \[0, 8\), got values in \[0, 8\]"):
        _nll.KERNEL.native(torch.zeros(2, 8), torch.tensor([0, 8]))
    with pytest.raises(ValueError, match=r"`logits` must have at least one class, got shape \(2, 0\)"):
        _nll.KERNEL.native(torch.zeros(2, 0), torch.tensor([0, 0]))


def test_the_library_is_built_into_the_cache_directory_and_reused(monkeypatch, tmp_path):
    monkeypatch.setenv(_native.CACHE_ENV, str(tmp_path))
    _native.build()
    built = sorted(p.name for p in tmp_path.iterdir())
    assert len(built) == 1 and built[0].endswith(".so")  # no source or partial file left behind
    stamp = (tmp_path / built[0]).stat().st_mtime_ns
    _native.build()
    assert sorted(p.name for p in tmp_path.iterdir()) == built
    assert (tmp_path / built[0]).stat().st_mtime_ns == stamp  # loaded, not compiled again


def test_a_build_failure_warns_once_and_falls_back_to_inductors_kernel_with_the_same_values(monkeypatch):
    import warnings

    def broken_build(*args):
        raise RuntimeError("cc failed: no space left")

    gen = torch.Generator().manual_seed(2)
    logits, ids = torch.randn(9, 5000, generator=gen), torch.randint(5000, (9,), generator=gen)
    native = token_nll(logits, ids, compiled=True)
    monkeypatch.setenv(NATIVE_ENV, "0")
    inductor = token_nll(logits, ids, compiled=True)
    monkeypatch.setenv(NATIVE_ENV, "1")
    monkeypatch.setattr(_nll, "KERNEL", _nll._CompiledKernel())
    monkeypatch.setattr(_native, "build", broken_build)
    with pytest.warns(DeterminismWarning, match=r"building the perplexity's C kernel failed \(RuntimeError: cc fai"):
        first = token_nll(logits, ids, compiled=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeterminismWarning)
        second = token_nll(logits, ids, compiled=True)  # warned once per process
    assert torch.equal(first, inductor) and torch.equal(second, inductor) and torch.equal(first, native)
    assert _nll.KERNEL.native.lib is None and _nll.KERNEL.fns  # Inductor's kernel computed them


def test_a_cached_file_that_does_not_load_is_built_again(monkeypatch, tmp_path):
    monkeypatch.setenv(_native.CACHE_ENV, str(tmp_path))
    compiler = _native.find_compiler()
    import subprocess

    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    target = tmp_path / _native.library_path(compiler, version, _native._flag_sets()[0]).split("/")[-1]
    target.write_bytes(b"not a library")  # a truncated write of an older release, say
    lib = _native.build()
    x, ids = torch.randn(3, 40), torch.tensor([1, 2, 3])
    outs = top, sum_hi, sum_lo, picked = torch.empty(3), *torch.empty(2, 3, dtype=torch.long), torch.empty(3)
    lib.ldet_row_sums(x.data_ptr(), ids.data_ptr(), 3, 40, 1, *(t.data_ptr() for t in outs))
    assert torch.equal(top, x.amax(-1)) and target.read_bytes() != b"not a library"


def test_the_metric_names_the_kernel_its_updates_used(monkeypatch):
    from lightning_determinism import DistributedPerplexity

    gen = torch.Generator().manual_seed(0)
    logits, target = torch.randn(4, 4096, generator=gen), torch.randint(4096, (4,), generator=gen)
    eager = DistributedPerplexity(compile=False)
    assert eager.kernel is None  # no update yet
    eager.update(logits, target)
    assert eager.kernel == "eager path"
    compiled = DistributedPerplexity(compile=True)
    compiled.update(logits, target)
    require_compiled_kernel()
    built = _nll.KERNEL.native.variant()
    assert compiled.kernel == f"C kernel ({built})" and built in (
        "vector block, AVX2", "vector block, NEON", "vector block, 128-bit or none", "auto-vectorised, AVX-512",
        "auto-vectorised (older compiler)",
    )  # fmt: skip
    import pickle

    # what a spawned rank and metric.clone() carry: the same name
    assert pickle.loads(pickle.dumps(compiled)).kernel == compiled.clone().kernel == compiled.kernel
    monkeypatch.setenv(NATIVE_ENV, "0")  # the C kernel turned off: Inductor's
    compiled.update(logits, target)
    assert compiled.kernel == "Inductor's kernel"
