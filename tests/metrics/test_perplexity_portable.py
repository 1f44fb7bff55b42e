"""One perplexity, bitwise, on every path: the C kernel, Inductor's kernel, the eager path without a compiler, and the
C kernel built for other vector widths (what another CPU would run). The references for the arithmetic itself are
Python's ``decimal`` at 40 digits: independent of torch, libm and this package."""

import ctypes
import math
import platform
import random
from decimal import Decimal, getcontext

import pytest
import torch

from lightning_determinism import DistributedPerplexity, perplexity
from lightning_determinism.metrics import _native, _nll, _portable
from lightning_determinism.metrics._nll import NATIVE_ENV, token_nll
from tests.helpers import require_compiled_kernel, requires_cuda

needs_compiler = pytest.mark.skipif(_native.find_compiler() is None, reason="no C compiler")


def _logits(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 4
    logits[0, :] = logits[0, 0]  # every logit equal (ties at the max)
    logits[1, 3] = 60.0  # one dominant logit: the other terms tiny, many below the floor
    logits[2, : vocab // 2] = -math.inf  # masked classes
    return logits.to(dtype), torch.randint(vocab, (rows,), generator=gen)


def _paths(monkeypatch, logits, ids, inductor=True):
    """token_nll on the C kernel, Inductor's kernel (or the eager path again: each dtype costs a compile) and eager."""
    monkeypatch.setenv(NATIVE_ENV, "1")
    native = token_nll(logits, ids, compiled=True)
    monkeypatch.setenv(NATIVE_ENV, "0")
    eager = token_nll(logits, ids, compiled=False, chunk_size=3)
    if not inductor:
        return native, eager, eager
    compiled = token_nll(logits, ids, compiled=True)
    require_compiled_kernel()
    return native, compiled, eager


@pytest.mark.parametrize(
    ("vocab", "dtype", "inductor"),
    [
        (5003, torch.float32, True),
        (4096, torch.bfloat16, False),  # Inductor compiles once per dtype (seconds with a cold cache): two suffice
        (4099, torch.float16, False),
        (300, torch.float32, False),  # float64 exponentials below 4,096 classes
        (5003, torch.float64, True),
    ],
)
def test_the_three_paths_give_the_same_bits(monkeypatch, vocab, dtype, inductor):
    logits, ids = _logits(11, vocab, dtype, seed=vocab)
    native, inductor, eager = _paths(monkeypatch, logits, ids, inductor)
    assert torch.equal(native, eager) and torch.equal(inductor, eager)
    # And they are the right numbers: within float32's rounding of a float64 reference (float64: 1e-13).
    reference = torch.nn.functional.cross_entropy(logits.double(), ids, reduction="none")
    tolerance = 1e-13 if dtype == torch.float64 or vocab < _portable.WIDE_BELOW else 1e-7
    torch.testing.assert_close(eager, reference, rtol=tolerance, atol=1e-12)


def test_non_finite_rows_agree_on_every_path(monkeypatch):
    logits, ids = _logits(6, 4100, torch.float32, seed=1)
    logits[0, 5] = math.nan
    logits[1, 7] = math.inf
    logits[2] = -math.inf
    logits[3, ids[3]] = -math.inf  # the target's logit -inf: NLL +inf
    native, inductor, eager = _paths(monkeypatch, logits, ids)
    for got in (native, inductor):
        assert torch.equal(got.isnan(), eager.isnan()) and torch.equal(got[~got.isnan()], eager[~eager.isnan()])
    assert eager.isnan().tolist() == [True, True, True, False, False, False] and eager[3] == math.inf


@needs_compiler
def test_no_compiler_on_the_path_computes_the_same_perplexity(monkeypatch, tmp_path):
    gen = torch.Generator().manual_seed(2)
    logits, ids = torch.randn(64, 8192, generator=gen) * 3, torch.randint(8192, (64,), generator=gen)
    with_compiler = DistributedPerplexity()  # compile=None: the C kernel for V >= 4096
    with_compiler.update(logits, ids)
    assert _nll.use_compiled(None, logits.device, 8192)
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc, gcc, clang, g++ ... here
    for name in ("CC", "CXX"):
        monkeypatch.delenv(name, raising=False)
    assert not _nll.use_compiled(None, logits.device, 8192)  # the eager path now
    without = DistributedPerplexity()
    without.update(logits, ids)
    assert torch.equal(with_compiler.compute(), without.compute())
    assert torch.equal(without.compute(), perplexity(logits, ids, compile=False))


def _built_with(flags: list[str], tmp_path) -> ctypes.CDLL:
    compiler = _native.find_compiler()
    target = str(tmp_path / f"row_sums_{abs(hash(tuple(flags)))}.so")
    error = _native._compile(compiler, [*flags, "-shared", "-fPIC", "-pthread"], target)
    if error is not None:
        pytest.skip(f"{compiler} {' '.join(flags)} failed here: {error[:200]}")
    lib = ctypes.CDLL(target)
    _native._declare_row_sums(lib)
    return lib


def _row_sums_of(lib: ctypes.CDLL, logits: torch.Tensor, ids: torch.Tensor, threads: int) -> list[torch.Tensor]:
    n = logits.shape[0]
    outs = [torch.empty(n), torch.empty(n, dtype=torch.long), torch.empty(n, dtype=torch.long), torch.empty(n)]
    lib.ldet_row_sums(logits.data_ptr(), ids.data_ptr(), n, logits.shape[1], threads, *(o.data_ptr() for o in outs))
    return outs


@needs_compiler
def test_the_c_kernel_built_for_other_vector_widths_gives_the_same_integers(tmp_path):
    # Another CPU builds the kernel with other vectors (-march=native): SSE2's 4 lanes, AVX2's 8, AVX-512's 16, or
    # none at all. Each exponential is rounded alone and the sums are integers, so every build must agree.
    base = ["-O3", "-std=c99", "-fopenmp-simd", "-ffp-contract=off", "-fno-math-errno"]
    builds = {"native": base + ["-march=native"], "no vectors": ["-O1", "-std=c99", "-ffp-contract=off"]}
    if platform.machine().lower() in ("x86_64", "amd64"):
        builds["SSE2"] = base + ["-march=x86-64"]
        builds["AVX2"] = base + ["-march=haswell", "-mno-avx512f"]
        # the loop left to the auto-vectoriser (the AVX-512DQ build's), here where it runs scalar
        builds["AVX2, auto-vectorised"] = base + ["-march=haswell", "-mno-avx512f", "-DLDET_NO_VECTOR_BLOCK"]
    logits, ids = _logits(19, 4133, torch.float32, seed=3)
    top, sum_hi, sum_lo = _portable.row_sums(logits)  # the eager arithmetic, as the reference
    for name, flags in builds.items():
        lib = _built_with(flags, tmp_path)
        if name == "AVX2":  # float -> int64 has no AVX2 instruction: the block is written with vectors there
            assert lib.ldet_row_sums_variant() == b"vector block, AVX2"
        if name.startswith("AVX2") and "avx2" not in open("/proc/cpuinfo").read():
            continue  # built, but this CPU cannot run it
        for threads in (1, 3):
            got = _row_sums_of(lib, logits, ids, threads)
            assert torch.equal(got[0], top) and torch.equal(got[1], sum_hi) and torch.equal(got[2], sum_lo), name


def test_exp_float_is_within_one_ulp_of_the_exact_value():
    getcontext().prec = 40
    rng = random.Random(0)
    xs = [rng.uniform(0, 700) for _ in range(3000)] + [rng.uniform(0, 12) for _ in range(3000)] + [0.0, 1.0, 709.7]
    worst = 0.0
    for x in xs:
        exact = Decimal(x).exp()
        got = _portable.exp_float(x)
        worst = max(worst, float(abs(Decimal(got) - exact) / Decimal(math.ulp(float(exact)))))
    assert worst <= 1.0, worst
    assert _portable.exp_float(710.0) == math.inf and math.isnan(_portable.exp_float(math.nan))


def test_log_fixed_is_within_two_ulps_of_the_exact_value():
    getcontext().prec = 40
    gen = torch.Generator().manual_seed(4)
    # S = hi * 2**32 + lo in [2**52, 2**69): a row sum from 1 up to 2**17 (all of 131,072 classes at the max).
    sum_hi = 2**20 + (torch.rand(4000, generator=gen, dtype=torch.float64) ** 4 * (2**37 - 2**20)).to(torch.int64)
    sum_lo = torch.randint(0, 2**32, (4000,), generator=gen, dtype=torch.int64)
    got = _portable.log_fixed(sum_hi, sum_lo)
    for hi, lo, value in zip(sum_hi.tolist(), sum_lo.tolist(), got.tolist(), strict=True):
        s = float(hi * 2**32 + lo) * 2.0**-52  # rounded once, as log_fixed does
        exact = Decimal(s).ln()
        assert abs(Decimal(value) - exact) <= 2 * Decimal(math.ulp(float(exact))), (hi, lo)
    assert math.isnan(float(_portable.log_fixed(torch.tensor([_portable.NAN_MARK]), torch.tensor([0]))[0]))


@requires_cuda
@pytest.mark.parametrize(("vocab", "dtype"), [(5003, torch.float32), (4096, torch.bfloat16), (300, torch.float32)])
def test_the_cuda_eager_path_gives_the_cpu_bits(vocab, dtype):
    # The same IEEE operations, each in a kernel of its own (nothing to contract), and integer sums.
    logits, ids = _logits(64, vocab, dtype, seed=5)
    cpu = token_nll(logits, ids, compiled=True)  # the C kernel where it applies
    cuda = token_nll(logits.cuda(), ids.cuda(), compiled=False).cpu()
    assert torch.equal(cpu.isnan(), cuda.isnan()) and torch.equal(cpu[~cpu.isnan()], cuda[~cuda.isnan()])
