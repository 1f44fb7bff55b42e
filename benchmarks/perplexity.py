"""DistributedPerplexity beside torchmetrics' Perplexity, on the same data in one run.

1. Accuracy over a stream of 26,213,200 tokens (V=16, updates of 65,537 tokens, so float32 counts must round):
   (a) accumulation: each metric's accumulated NLL sum against ``math.fsum`` of the per-token NLL values that same
       metric computed (target <= 1e-12 relative; count exact);
   (b) end to end: perplexity against a float64 reference from the same logits (``F.cross_entropy`` in float64
       summed with ``math.fsum``; target <= 1e-9 relative).
   Then the same two figures on LM-like logits: V=32,000, peaked (standard deviation 6) with each target drawn from
   the model's own distribution, so the NLL is low as for a trained model and each row's sum of exponentials is
   dominated by a few terms (where a float32 row sum drops the many tiny ones; shown beside, as an ablation), for
   the C kernel, Inductor's kernel and the eager path.
2. Update throughput at V=32,000, 4,096 tokens per update, float32 logits (target >= 4x torchmetrics on an idle
   machine, >= 2x with a competing CPU-bound process), for the C kernel (the default), Inductor's kernel and the
   eager path; the first update's cost in a fresh process (building the kernel), each kernel's cache cold and warm.
2a. The C kernel per vector instruction set (`--only vectors`): built for this CPU (-march=native), for AVX2
   (-march=haswell: what an AVX2-only CPU such as AMD EPYC Zen 2/3 builds) and for SSE2 (-march=x86-64), each in a
   fresh process (LDET_KERNEL_MARCH, a private kernel cache), V=32,000, 4,096 tokens: seconds per update against
   torchmetrics, interleaved (target >= 4x), with this CPU's vector features printed beside.
2b. One value on every path and CPU: the perplexity of fixed logits (V=32,000, float32 and bfloat16) with the C kernel,
   Inductor's kernel, the eager path, a fresh process with no compiler on the PATH, and the C kernel built for other
   vector widths (SSE2, AVX2, AVX-512, no vectors: what other x86-64 CPUs build with -march=native), as float.hex.
3. Invariance: the perplexity over a 997-sample set at batch sizes 1, 7 and 32 (bitwise equal?) and the cost of the
   exact accumulation per update.
4. Peak extra memory of one update at V=32,000, 8,192 tokens: the process's peak RSS during the update minus its
   RSS just before (Linux: VmHWM reset through /proc/self/clear_refs) (target <= 0.1x torchmetrics).

    python benchmarks/perplexity.py [--tokens 26213200] [--lm-tokens 131072] [--skip-accuracy]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torchmetrics.text import Perplexity

from lightning_determinism import DistributedPerplexity
from lightning_determinism.exact import exact_sum
from lightning_determinism.metrics._native import CACHE_ENV, MARCH_ENV
from lightning_determinism.metrics._nll import NATIVE_ENV, token_nll


def _batch(gen: torch.Generator, tokens: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(1, tokens, vocab, generator=gen) * 2.0
    target = torch.randint(vocab, (1, tokens), generator=gen)
    return logits, target


def _table(rows: list[tuple[str, ...]], columns: tuple[str, ...] = ("ours", "torchmetrics")) -> None:
    print(f"   {'':72s}" + "".join(f"{c:>16s}" for c in columns))
    for label, *cells in rows:
        print(f"   {label:72s}" + "".join(f"{c:>16s}" for c in cells))


def accuracy(total_tokens: int, vocab: int = 16, per_update: int = 65_537) -> None:
    gen = torch.Generator().manual_seed(0)
    ours, theirs = DistributedPerplexity(), Perplexity()
    ref_terms: list[float] = []
    our_terms: list[float] = []
    their_terms: list[float] = []
    done = 0
    while done < total_tokens:
        n = min(per_update, total_tokens - done)
        logits, target = _batch(gen, n, vocab)
        ours.update(logits, target)
        theirs.update(logits, target)
        flat, ids = logits.reshape(-1, vocab), target.reshape(-1)
        ref_terms.append(math.fsum(F.cross_entropy(flat.double(), ids, reduction="none").tolist()))
        our_terms.append(math.fsum(token_nll(flat, ids).tolist()))  # V=16: the eager path, as the metric's
        probs = torch.softmax(flat, dim=-1)[torch.arange(n), ids]  # torchmetrics' own per-token path
        their_terms.append(math.fsum((-probs.log()).double().tolist()))
        done += n
    ref_sum, our_sum, their_sum = math.fsum(ref_terms), math.fsum(our_terms), math.fsum(their_terms)
    ref_ppl = math.exp(ref_sum / total_tokens)
    rows = [
        (f"count (exact: {total_tokens})", f"{int(ours.count)}", f"{float(theirs.count):.0f}"),
        (
            "(a) accumulated sum vs fsum of own per-token NLL, rel. error (<= 1e-12)",
            f"{abs(float(ours.nll_sum) - our_sum) / our_sum:.2e}",
            f"{abs(float(theirs.total_log_probs) - their_sum) / their_sum:.2e}",
        ),
        (
            "(b) perplexity vs float64 reference, rel. error (<= 1e-9)",
            f"{abs(float(ours.compute()) - ref_ppl) / ref_ppl:.2e}",
            f"{abs(float(theirs.compute()) - ref_ppl) / ref_ppl:.2e}",
        ),
    ]
    print(f"\n1. accuracy over {total_tokens:,} tokens, V={vocab}; reference perplexity {ref_ppl:.12f}")
    _table(rows)


class _InductorPerplexity(DistributedPerplexity):
    """The compiled path on Inductor's kernel (the C kernel switched off around each update)."""

    def update(self, *args, **kwargs):  # type: ignore[override]
        before = os.environ.get(NATIVE_ENV)
        os.environ[NATIVE_ENV] = "0"
        try:
            return super().update(*args, **kwargs)
        finally:
            if before is None:
                del os.environ[NATIVE_ENV]
            else:
                os.environ[NATIVE_ENV] = before


def _float32_row_sum_nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The ablation: the metric's formula with each row's exponentials summed in float32 (as before 0.1.0)."""
    top = logits.amax(dim=-1, keepdim=True)
    sums = (logits - top).clamp_(min=-87.0).exp_().sum(dim=-1)
    return (top.double() - logits.gather(-1, ids[:, None]).double()).squeeze(-1) + sums.double().log()


def lm_like_accuracy(total_tokens: int, vocab: int = 32_000, per_update: int = 4_096, scale: float = 6.0) -> None:
    gen = torch.Generator().manual_seed(2)
    compiled, eager, theirs = DistributedPerplexity(compile=True), DistributedPerplexity(compile=False), Perplexity()
    inductor = _InductorPerplexity(compile=True)
    ref_terms: list[float] = []
    our_terms: list[float] = []
    f32_terms: list[float] = []
    done = 0
    while done < total_tokens:
        n = min(per_update, total_tokens - done)
        logits = torch.randn(n, vocab, generator=gen) * scale
        reference = F.log_softmax(logits.double(), dim=-1)
        cdf = reference.exp().cumsum_(dim=-1)  # inverse-CDF sampling: torch.multinomial is ~50x slower here
        u = torch.rand(n, 1, dtype=torch.float64, generator=gen) * cdf[:, -1:]
        target = torch.searchsorted(cdf, u).squeeze(-1).clamp_(max=vocab - 1)
        compiled.update(logits, target)
        inductor.update(logits, target)
        eager.update(logits, target)
        theirs.update(logits[None], target[None])
        ref_terms.append(-math.fsum(reference.gather(-1, target[:, None]).squeeze(-1).tolist()))
        our_terms.append(math.fsum(token_nll(logits, target, compiled=True).tolist()))
        f32_terms.append(math.fsum(_float32_row_sum_nll(logits, target).tolist()))
        done += n
    ref_ppl = math.exp(math.fsum(ref_terms) / total_tokens)
    f32_ppl = math.exp(math.fsum(f32_terms) / total_tokens)

    def rel(value: float) -> str:
        return f"{abs(value - ref_ppl) / ref_ppl:.2e}"

    rows = [
        (
            "(a) accumulated sum vs fsum of own per-token NLL, rel. error (<= 1e-12)",
            f"{abs(float(compiled.nll_sum) - math.fsum(our_terms)) / math.fsum(our_terms):.2e}",
            "",
            "",
            "",
        ),
        (
            "(b) perplexity vs float64 reference, rel. error (<= 1e-9)",
            rel(float(compiled.compute())),
            rel(float(inductor.compute())),
            rel(float(eager.compute())),
            rel(float(theirs.compute())),
        ),
        ("    ablation: the same with float32 row sums, rel. error", rel(f32_ppl), "", "", ""),
    ]
    print(
        f"\n1b. LM-like logits (std {scale:g}, targets drawn from the model), {total_tokens:,} tokens, V={vocab:,};"
        f" reference perplexity {ref_ppl:.12f}"
    )
    _table(rows, ("ours C kernel", "ours Inductor", "ours eager", "torchmetrics"))


def _medians(metrics: dict[str, object], logits: torch.Tensor, target: torch.Tensor, repeats: int) -> dict[str, float]:
    for metric in metrics.values():
        metric.update(logits, target)  # warm-up (and compile)
    times: dict[str, list[float]] = {name: [] for name in metrics}
    for _ in range(repeats):  # interleaved, so drift in machine load hits all alike
        for name, metric in metrics.items():
            start = time.perf_counter()
            metric.update(logits, target)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _medians_alone(metrics: dict[str, object], logits: torch.Tensor, target: torch.Tensor, repeats: int) -> dict:
    """Each metric timed in a loop of its own: no other metric's memory traffic between two of its updates."""
    out = {}
    for name, metric in metrics.items():
        metric.update(logits, target)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            metric.update(logits, target)
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times)
    return out


_FIRST_UPDATE_CHILD = """
import json, sys, time, torch
from lightning_determinism import DistributedPerplexity
gen = torch.Generator().manual_seed(1)
logits, target = torch.randn(1, 4096, 32000, generator=gen), torch.randint(32000, (1, 4096), generator=gen)
metric = DistributedPerplexity(compile=True)
start = time.perf_counter(); metric.update(logits, target); first = time.perf_counter() - start
start = time.perf_counter(); metric.update(logits[:, :1000], target[:, :1000]); other = time.perf_counter() - start
print(json.dumps({"first": first, "other_length": other}))
"""


def _first_update(cache_dir: str | None, native: bool) -> dict[str, float]:
    env = dict(os.environ)
    env[NATIVE_ENV] = "1" if native else "0"
    if cache_dir is not None:
        env["TORCHINDUCTOR_CACHE_DIR" if not native else CACHE_ENV] = cache_dir
    out = subprocess.run([sys.executable, "-c", _FIRST_UPDATE_CHILD], capture_output=True, text=True, env=env)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def throughput(vocab: int = 32_000, tokens: int = 4_096, repeats: int = 15) -> None:
    gen = torch.Generator().manual_seed(1)
    logits, target = _batch(gen, tokens, vocab)
    metrics = {
        "C kernel": DistributedPerplexity(compile=True),
        "Inductor": _InductorPerplexity(compile=True),
        "eager": DistributedPerplexity(compile=False),
        "torchmetrics": Perplexity(),
    }
    idle = _medians(metrics, logits, target, repeats)
    alone = _medians_alone(metrics, logits, target, repeats)
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # a competing CPU-bound process
    try:
        time.sleep(0.5)
        busy = _medians(metrics, logits, target, repeats)
    finally:
        hog.kill()
        hog.wait()
    first = {}
    for native in (True, False):
        with tempfile.TemporaryDirectory() as cold_dir:
            first[native, "cold"] = _first_update(cold_dir, native)
        first[native, "warm"] = _first_update(None, native)
    print(f"\n2. update throughput, V={vocab:,}, {tokens:,} tokens/update, float32, {torch.get_num_threads()} threads")
    rows = []
    # Interleaved, every update of ours follows one of torchmetrics', whose 524 MB softmax output has just evicted
    # the caches; alone, each metric runs after itself, as in a training loop that uses one metric.
    runs = (("idle, interleaved", idle), ("idle, each metric alone", alone), ("one competing CPU-bound process", busy))
    for label, figures in runs:
        tm = figures["torchmetrics"]
        rows.append((f"{label}: median seconds per update", *(f"{figures[k]:.4f}" for k in metrics)))
        target_note = ">= 2x" if label.startswith("one competing") else ">= 4x"
        rows.append(
            (f"{label}: speed-up over torchmetrics ({target_note})", *(f"{tm / figures[k]:.2f}x" for k in metrics))
        )
    for state, what in (("cold", "cache cold (compiles)"), ("warm", "cache warm")):
        rows.append(
            (
                f"first update in a fresh process, {what}",
                *(f"{first[n, state]['first']:.2f} s" for n in (True, False)),
                "",
                "",
            )
        )  # noqa: E501
    rows.append(
        (
            "then a new sequence length (1,000 tokens): no recompile",
            *(f"{first[n, 'warm']['other_length']:.3f} s" for n in (True, False)),
            "",
            "",
        )
    )  # noqa: E501
    _table(rows, tuple(metrics))


_VECTORS_CHILD = """
import json, sys
import torch
from torchmetrics.text import Perplexity
sys.path.insert(0, sys.argv[1])
from perplexity import _batch, _medians
from lightning_determinism import DistributedPerplexity
logits, target = _batch(torch.Generator().manual_seed(1), 4_096, 32_000)
metrics = {"C kernel": DistributedPerplexity(compile=True), "torchmetrics": Perplexity()}
figures = _medians(metrics, logits, target, 15)
print(json.dumps({**figures, "variant": metrics["C kernel"].kernel}))
"""


def _vector_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line for line in f if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown (no /proc/cpuinfo)"
    wanted = ("sse2", "avx", "avx2", "fma", "avx512f", "avx512dq", "avx512bw", "avx512vl")
    return " ".join(flag for flag in wanted if flag in flags)


def vectors() -> None:
    threads = torch.get_num_threads()
    print(f"\n2a. the C kernel per vector instruction set, V=32,000, 4,096 tokens/update, {threads} threads;"
          f" this CPU: {_vector_features()}")  # fmt: skip
    rows = []
    for march, label in ((None, "this CPU (-march=native)"), ("haswell", "AVX2 (-march=haswell)"),
                         ("x86-64", "SSE2 (-march=x86-64)")):  # fmt: skip
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, CACHE_ENV: cache, **({MARCH_ENV: march} if march else {})}
            env.pop(MARCH_ENV, None) if march is None else None
            out = subprocess.run([sys.executable, "-c", _VECTORS_CHILD, os.path.dirname(os.path.abspath(__file__))],
                                 env=env, capture_output=True, text=True, check=True)  # fmt: skip
        figures = json.loads(out.stdout.strip().splitlines()[-1])
        tm, ours = figures["torchmetrics"], figures["C kernel"]
        rows.append((label, figures["variant"], f"{ours:.4f} s", f"{tm:.4f} s", f"{tm / ours:.2f}x"))
    _table(rows, ("kernel variant", "C kernel", "torchmetrics", "x faster"))


_NO_COMPILER_CHILD = """
import sys, torch
from lightning_determinism import DistributedPerplexity
from lightning_determinism.metrics._nll import use_compiled
gen = torch.Generator().manual_seed(int(sys.argv[1]))
logits = (torch.randn(512, 32_000, generator=gen) * 3).to(getattr(torch, sys.argv[2]))
target = torch.randint(32_000, (512,), generator=gen)
assert not use_compiled(None, logits.device, 32_000)
metric = DistributedPerplexity()
metric.update(logits, target)
print(float(metric.compute()).hex())
"""


def _ppl_from_row_sums(sums: list[torch.Tensor]) -> str:
    """The perplexity from a kernel's row sums, as the metric finishes it (NLL, exact mean, exp)."""
    from lightning_determinism.exact import exact_mean, exact_sum
    from lightning_determinism.metrics._nll import nll_from_row_sums
    from lightning_determinism.metrics._portable import exp_float

    nll = nll_from_row_sums(*sums)
    return exp_float(exact_mean(exact_sum(nll), nll.numel())).hex()


def portability(seed: int = 7) -> None:
    import ctypes
    import platform

    from lightning_determinism.metrics import _native

    print("\n2b. one value on every path (V=32,000, 512 tokens; float.hex of the perplexity)")
    rows = []
    for dtype in ("float32", "bfloat16"):
        gen = torch.Generator().manual_seed(seed)
        logits = (torch.randn(512, 32_000, generator=gen) * 3).to(getattr(torch, dtype))
        target = torch.randint(32_000, (512,), generator=gen)
        values = {"C kernel": DistributedPerplexity(compile=True), "Inductor": _InductorPerplexity(compile=True),
                  "eager": DistributedPerplexity(compile=False)}  # fmt: skip
        found = {}
        for name, metric in values.items():
            metric.update(logits, target)
            found[name] = float(metric.compute()).hex()
        with tempfile.TemporaryDirectory() as empty:
            child = subprocess.run([sys.executable, "-c", _NO_COMPILER_CHILD, str(seed), dtype], capture_output=True,
                                   text=True, check=True, env={**os.environ, "PATH": empty})  # fmt: skip
            found["no compiler (fresh process)"] = child.stdout.strip()
            base = ["-O3", "-std=c99", "-fopenmp-simd", "-ffp-contract=off", "-fno-math-errno"]
            builds = {"C, no vectors (-O1)": ["-O1", "-std=c99", "-ffp-contract=off"]}
            if platform.machine().lower() in ("x86_64", "amd64"):
                builds["C, SSE2 (-march=x86-64)"] = [*base, "-march=x86-64"]
                builds["C, AVX2 (-march=haswell)"] = [*base, "-march=haswell", "-mno-avx512f"]
                builds["C, AVX-512 (-march=native)"] = [*base, "-march=native", "-mprefer-vector-width=512"]
            upcast = logits.float()
            for name, flags in builds.items():
                target_so = os.path.join(empty, f"{abs(hash(name))}.so")
                error = _native._compile(_native.find_compiler() or "cc", [*flags, "-shared", "-fPIC", "-pthread"],
                                         target_so)  # fmt: skip
                if error is not None:
                    found[name] = "build failed"
                    continue
                lib = ctypes.CDLL(target_so)
                _native._declare_row_sums(lib)
                outs = [torch.empty(512), torch.empty(512, dtype=torch.long), torch.empty(512, dtype=torch.long),
                        torch.empty(512)]  # fmt: skip
                lib.ldet_row_sums(upcast.data_ptr(), target.data_ptr(), 512, 32_000, 2, outs[0].data_ptr(),
                                  outs[1].data_ptr(), outs[2].data_ptr(), outs[3].data_ptr())  # fmt: skip
                found[name] = _ppl_from_row_sums(outs)
        reference = math.exp(F.cross_entropy(logits.double(), target).item())
        found["float64 reference (F.cross_entropy, math.exp)"] = reference.hex()
        distinct = {v for k, v in found.items() if not k.startswith("float64")}
        for name, value in found.items():
            rows.append((f"{dtype}: {name}", value))
        rows.append((f"{dtype}: distinct values among the paths (1 wanted)", str(len(distinct))))
    _table(rows, ("perplexity",))


def invariance(repeats: int = 20) -> None:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(257, (997, 7), generator=gen)
    table = torch.randn(257, 257, generator=gen) * 3
    values = []
    for batch_size in (1, 7, 32):
        metric = DistributedPerplexity(compile=True)
        for start in range(0, 997, batch_size):
            batch = ids[start : start + batch_size]
            metric.update(table[batch[:, :-1]], batch[:, 1:])
        values.append(metric.compute())
    same = all(torch.equal(values[0], v) for v in values[1:])
    nll = torch.rand(4096, dtype=torch.float64, generator=gen) * 10  # the cost does not depend on the values
    exact_s, float_s = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        exact_sum(nll)
        exact_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        nll.sum()
        float_s.append(time.perf_counter() - start)
    print("\n3. invariance: 997 samples, V=257, batch sizes 1, 7, 32")
    _table(
        [
            ("perplexity bitwise identical across batch sizes", "yes" if same else "NO"),
            ("exact accumulation of 4,096 token NLLs, ms", f"{statistics.median(exact_s) * 1e3:.3f}"),
            ("a plain float64 sum of the same, ms", f"{statistics.median(float_s) * 1e3:.3f}"),
        ],
        ("ours",),
    )


_MEMORY_CHILD = """
import json, sys, torch
from torchmetrics.text import Perplexity
from lightning_determinism import DistributedPerplexity

def status_kib(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])

vocab, tokens, which = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
gen = torch.Generator().manual_seed(2)
logits = torch.randn(1, tokens, vocab, generator=gen)
target = torch.randint(vocab, (1, tokens), generator=gen)
if which == "torchmetrics":
    metric = Perplexity()
else:
    metric = DistributedPerplexity(compile=which == "compiled")
metric.update(logits[:, :8], target[:, :8])  # first-call allocations (and the compile) are not the update's
before = status_kib("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the high-water mark VmHWM to the current RSS
metric.update(logits, target)
print(json.dumps({"extra_kib": status_kib("VmHWM") - before}))
"""


def memory(vocab: int = 32_000, tokens: int = 8_192) -> None:
    extra = {}
    for which in ("compiled", "eager", "torchmetrics"):
        # A fixed mmap threshold: every large allocation is a fresh mapping, so the peak RSS sees it (with glibc's
        # sliding threshold, freed heap from earlier work would be reused unseen).
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
        out = subprocess.run(
            [sys.executable, "-c", _MEMORY_CHILD, str(vocab), str(tokens), which],
            capture_output=True,
            text=True,
            check=True,
            env=env,
        )
        extra[which] = json.loads(out.stdout.strip().splitlines()[-1])["extra_kib"] / 1024
    print(f"\n4. peak extra memory of one update, V={vocab:,}, {tokens:,} tokens (input itself: "
          f"{vocab * tokens * 4 / 2**20:,.0f} MiB)")  # fmt: skip
    tm = max(extra["torchmetrics"], 1e-9)
    _table(
        [
            ("peak RSS during update minus RSS before, MiB", *(f"{extra[k]:.1f}" for k in extra)),
            ("ratio to torchmetrics (<= 0.1)", *(f"{extra[k] / tm:.3f}" for k in extra)),
        ],
        tuple(extra),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=26_213_200)
    parser.add_argument("--lm-tokens", type=int, default=131_072)
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--only", choices=("throughput", "vectors", "portability"), help="run one section alone")
    args = parser.parse_args()
    if args.only:
        {"throughput": throughput, "vectors": vectors, "portability": portability}[args.only]()
        return
    if not args.skip_accuracy:
        accuracy(args.tokens)
        lm_like_accuracy(args.lm_tokens)
    throughput()
    vectors()
    portability()
    invariance()
    memory()


if __name__ == "__main__":
    main()
