"""Identical bits whatever the batch split and the number of threads, on the eager and the compiled path."""

import pytest
import torch

from lightning_determinism import DistributedMean, DistributedPerplexity
from lightning_determinism.metrics._nll import KERNEL, NATIVE_ENV, token_nll
from tests.helpers import require_compiled_kernel

N_SAMPLES, LENGTH, VOCAB = 997, 6, 257


def eval_set(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """997 samples of token ids, and a fixed logit table: a sample's logits never depend on its batch."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(VOCAB, (N_SAMPLES, LENGTH + 1), generator=gen)
    table = torch.randn(VOCAB, VOCAB, generator=gen) * 3
    return ids, table


def evaluate(indices: list[int], batch_size: int, compile: bool, seed: int = 0):
    """A metric fed ``indices`` of the eval set in batches, the way a validation loop feeds it."""
    ids, table = eval_set(seed)
    ppl, mean = DistributedPerplexity(compile=compile), DistributedMean()
    for start in range(0, len(indices), batch_size):
        batch = ids[indices[start : start + batch_size]]
        logits = table[batch[:, :-1]]
        ppl.update(logits, batch[:, 1:])
        mean.update(token_nll(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1), compiled=compile))
    return ppl, mean


@pytest.fixture(scope="module", params=["eager", "native", "inductor"])
def path(request):
    """The three kernels: eager, the C kernel (float32 on CPU) and Inductor's (its fallback, and float64's)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(NATIVE_ENV, "0" if request.param == "inductor" else "1")
        if request.param != "eager":
            evaluate(list(range(4)), 4, True)  # compile once for the module (and for forked ranks that follow)
            require_compiled_kernel()
        yield request.param != "eager"


def test_batch_sizes_1_7_32_give_the_same_bits(path):
    results = [evaluate(list(range(N_SAMPLES)), bs, path) for bs in (1, 7, 32)]
    values = [(ppl.compute(), mean.compute()) for ppl, mean in results]
    assert all(torch.equal(values[0][0], v[0]) and torch.equal(values[0][1], v[1]) for v in values[1:])
    assert all(int(ppl.count) == N_SAMPLES * LENGTH for ppl, _ in results)
    assert torch.equal(values[0][0], values[0][1].exp())  # the same exact mean NLL, two metrics


def test_shuffled_order_gives_the_same_bits(path):
    order = torch.randperm(N_SAMPLES, generator=torch.Generator().manual_seed(3)).tolist()
    straight, _ = evaluate(list(range(N_SAMPLES)), 32, path)
    shuffled, _ = evaluate(order, 32, path)
    assert torch.equal(straight.compute(), shuffled.compute())


def test_one_row_alone_equals_the_same_row_in_a_batch_on_1_2_and_4_threads(path):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(40, 5000, generator=gen) * 4  # rows long enough for torch to split one across threads
    ids = torch.randint(5000, (40,), generator=gen)
    threads = torch.get_num_threads()
    try:
        batched = token_nll(logits, ids, compiled=path)
        for n in (1, 2, 4):  # 4: more threads than rows' blocks of the C kernel, each claiming what it can
            torch.set_num_threads(n)
            alone = torch.cat([token_nll(logits[i : i + 1], ids[i : i + 1], compiled=path) for i in range(40)])
            assert torch.equal(alone, batched)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_compiled_path_takes_every_float_dtype(dtype):
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(9, VOCAB, generator=gen) * 3).to(dtype)
    ids = torch.randint(VOCAB, (9,), generator=gen)
    expected = torch.nn.functional.cross_entropy(logits.double(), ids, reduction="none")
    got = token_nll(logits, ids, compiled=True)
    require_compiled_kernel()
    assert torch.allclose(got, expected, rtol=1e-6 if dtype != torch.float64 else 1e-12, atol=0)


def test_a_compile_failure_warns_once_and_falls_back_to_the_eager_values(monkeypatch):
    import warnings

    from lightning_determinism import DeterminismWarning, perplexity
    from lightning_determinism.metrics import _nll

    def broken_compile(fn, **kwargs):
        def run(*args):
            raise RuntimeError("no working C++ compiler")

        return run

    monkeypatch.setattr(_nll, "KERNEL", _nll._CompiledKernel())
    monkeypatch.setattr(torch, "compile", broken_compile)
    monkeypatch.setenv(NATIVE_ENV, "0")  # the C kernel's own fallback: tests/metrics/test_perplexity_native.py
    logits, target = torch.randn(3, 4, VOCAB), torch.randint(VOCAB, (3, 4))
    with pytest.warns(DeterminismWarning, match="compiling the perplexity kernel failed .*no working C\\+\\+ compiler"):
        first = perplexity(logits, target, compile=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeterminismWarning)
        second = perplexity(logits, target, compile=True)  # warned once per process
    eager = perplexity(logits, target, compile=False)
    assert torch.equal(first, eager) and torch.equal(second, eager)
    assert not _nll.use_compiled(None, torch.device("cpu"), 50_000)  # auto mode no longer tries


def test_auto_mode_and_the_environment_switch(monkeypatch):
    from lightning_determinism.metrics._nll import COMPILE_ENV, use_compiled

    cpu = torch.device("cpu")
    assert not use_compiled(None, cpu, 4095)
    monkeypatch.setenv(COMPILE_ENV, "0")
    assert not use_compiled(None, cpu, 50_000)
    monkeypatch.setenv(COMPILE_ENV, "1")
    assert use_compiled(None, cpu, 10) == KERNEL.available()
    assert not use_compiled(False, cpu, 50_000)
    with pytest.raises(TypeError, match="`compile` must be True, False or None"):
        DistributedPerplexity(compile="yes")
