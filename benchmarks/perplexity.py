"""DistributedPerplexity beside torchmetrics' Perplexity, on the same data in one run.

1. Accuracy over a stream of 26,213,200 tokens (V=16, updates of 65,537 tokens, so float32 counts must round):
   (a) accumulation: each metric's accumulated NLL sum against ``math.fsum`` of the per-token NLL values that same
       metric computed (target <= 1e-12 relative; count exact);
   (b) end to end: perplexity against a float64 reference from the same logits (``F.cross_entropy`` in float64
       summed with ``math.fsum``; target <= 1e-9 relative).
   Then the same two figures on LM-like logits: V=32,000, peaked (standard deviation 6) with each target drawn from
   the model's own distribution, so the NLL is low as for a trained model and each row's sum of exponentials is
   dominated by a few terms (where a float32 row sum drops the many tiny ones; shown beside, as an ablation).
2. Update throughput at V=32,000, 4,096 tokens per update, float32 logits (target >= 3x torchmetrics).
3. Peak extra memory of one update at V=32,000, 8,192 tokens: the process's peak RSS during the update minus its
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
import time

import torch
import torch.nn.functional as F
from torchmetrics.text import Perplexity

from lightning_determinism import DistributedPerplexity
from lightning_determinism.metrics.perplexity import _token_nll


def _batch(gen: torch.Generator, tokens: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(1, tokens, vocab, generator=gen) * 2.0
    target = torch.randint(vocab, (1, tokens), generator=gen)
    return logits, target


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
        our_terms.append(math.fsum(_token_nll(flat, ids).tolist()))
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


def _float32_row_sum_nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The ablation: the metric's formula with each row's exponentials summed in float32 (as before 0.1.0)."""
    top = logits.amax(dim=-1, keepdim=True)
    sums = (logits - top).clamp_(min=-87.0).exp_().sum(dim=-1)
    return (top.double() - logits.gather(-1, ids[:, None]).double()).squeeze(-1) + sums.double().log()


def lm_like_accuracy(total_tokens: int, vocab: int = 32_000, per_update: int = 4_096, scale: float = 6.0) -> None:
    gen = torch.Generator().manual_seed(2)
    ours, theirs = DistributedPerplexity(), Perplexity()
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
        ours.update(logits, target)
        theirs.update(logits[None], target[None])
        ref_terms.append(-math.fsum(reference.gather(-1, target[:, None]).squeeze(-1).tolist()))
        our_terms.append(math.fsum(_token_nll(logits, target).tolist()))
        f32_terms.append(math.fsum(_float32_row_sum_nll(logits, target).tolist()))
        done += n
    ref_sum = math.fsum(ref_terms)
    ref_ppl = math.exp(ref_sum / total_tokens)
    f32_ppl = math.exp(math.fsum(f32_terms) / total_tokens)
    rows = [
        (
            "(a) accumulated sum vs fsum of own per-token NLL, rel. error (<= 1e-12)",
            f"{abs(float(ours.nll_sum) - math.fsum(our_terms)) / math.fsum(our_terms):.2e}",
            "",
        ),
        (
            "(b) perplexity vs float64 reference, rel. error (<= 1e-9)",
            f"{abs(float(ours.compute()) - ref_ppl) / ref_ppl:.2e}",
            f"{abs(float(theirs.compute()) - ref_ppl) / ref_ppl:.2e}",
        ),
        ("    ablation: the same with float32 row sums, rel. error", f"{abs(f32_ppl - ref_ppl) / ref_ppl:.2e}", ""),
    ]
    print(
        f"\n1b. LM-like logits (std {scale:g}, targets drawn from the model), {total_tokens:,} tokens, V={vocab:,};"
        f" reference perplexity {ref_ppl:.12f}"
    )
    _table(rows)


def throughput(vocab: int = 32_000, tokens: int = 4_096, repeats: int = 15) -> None:
    gen = torch.Generator().manual_seed(1)
    logits, target = _batch(gen, tokens, vocab)
    ours, theirs = DistributedPerplexity(), Perplexity()
    for metric in (ours, theirs):
        metric.update(logits, target)  # warm-up
    times: dict[str, list[float]] = {"ours": [], "torchmetrics": []}
    for _ in range(repeats):  # interleaved, so drift in machine load hits both alike
        for name, metric in (("ours", ours), ("torchmetrics", theirs)):
            start = time.perf_counter()
            metric.update(logits, target)
            times[name].append(time.perf_counter() - start)
    ours_s, theirs_s = statistics.median(times["ours"]), statistics.median(times["torchmetrics"])
    print(f"\n2. update throughput, V={vocab:,}, {tokens:,} tokens/update, float32, {torch.get_num_threads()} threads")
    _table(
        [
            ("median seconds per update", f"{ours_s:.4f}", f"{theirs_s:.4f}"),
            ("tokens per second", f"{tokens / ours_s:,.0f}", f"{tokens / theirs_s:,.0f}"),
            ("speed-up over torchmetrics (>= 3x)", f"{theirs_s / ours_s:.2f}x", "1.00x"),
        ]
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
metric = DistributedPerplexity() if which == "ours" else Perplexity()
metric.update(logits[:, :8], target[:, :8])  # first-call allocations are not the update's
before = status_kib("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the high-water mark VmHWM to the current RSS
metric.update(logits, target)
print(json.dumps({"extra_kib": status_kib("VmHWM") - before}))
"""


def memory(vocab: int = 32_000, tokens: int = 8_192) -> None:
    extra = {}
    for which in ("ours", "torchmetrics"):
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
    print(f"\n3. peak extra memory of one update, V={vocab:,}, {tokens:,} tokens (input itself: "
          f"{vocab * tokens * 4 / 2**20:,.0f} MiB)")  # fmt: skip
    _table(
        [
            ("peak RSS during update minus RSS before, MiB", f"{extra['ours']:.1f}", f"{extra['torchmetrics']:.1f}"),
            ("ratio to torchmetrics (<= 0.1)", f"{extra['ours'] / max(extra['torchmetrics'], 1e-9):.3f}", "1.000"),
        ]
    )


def _table(rows: list[tuple[str, str, str]]) -> None:
    print(f"   {'':74s}{'ours':>14s}{'torchmetrics':>14s}")
    for label, a, b in rows:
        print(f"   {label:74s}{a:>14s}{b:>14s}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=26_213_200)
    parser.add_argument("--lm-tokens", type=int, default=131_072)
    parser.add_argument("--skip-accuracy", action="store_true")
    args = parser.parse_args()
    if not args.skip_accuracy:
        accuracy(args.tokens)
        lm_like_accuracy(args.lm_tokens)
    throughput()
    memory()


if __name__ == "__main__":
    main()
