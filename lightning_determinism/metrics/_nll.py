"""Per-token negative log-likelihood whose value for one row never depends on the other rows of the batch.

``nll = (max - x_target) + log(sum(exp(x - max)))`` per row of logits ``[N, V]``: the difference is taken in
float64, the exponentials in float32 (in float64 on the eager path on CPU, and on CUDA below 4096 classes) and each
row's sum of them is accumulated in float64.

Batch invariance (the same bits for a row whether it comes alone, among 7 or among 32 rows, on 1 thread or 16) is
what makes a metric identical on any world size. PyTorch's own reductions do not give it: a sum with one output row
is split across threads, so one row summed alone is added in another order than the same row inside a batch. Two
paths give it here:

- **compiled** (CPU default for large vocabularies): one kernel for row max, ``exp(x - max)`` summed in float64
  and the target gather. For float32, float16 and bfloat16 logits on CPU it is the C kernel of
  :mod:`~lightning_determinism.metrics._native` (built once per machine); for float64 logits, on CUDA, or where no
  C compiler works, the one ``torch.compile`` (Inductor) generates from :func:`_row_stats`, with the row count
  compiled as a size without a hint (``mark_unbacked``) so the code is the same for every batch size. In both,
  rows are shared among threads and each row is reduced by one thread with the same vector loop.
- **eager**: exact operations (max, subtraction, clamping, upcasting) in torch, then ``exp`` and the float64 row
  sums in numpy, whose loops are single-threaded and treat every element, and every row, alike.

The final ``log`` is numpy's as well (torch's vectorised and scalar ``log`` may differ in the last bit, and which one
a row meets depends on its position). On CUDA the eager path uses torch throughout and batch invariance is not
claimed (see docs/perplexity.md).
"""

from __future__ import annotations

import os
import shutil
import warnings
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_determinism._compat.checks import mark_unbacked
from lightning_determinism.errors import DeterminismWarning
from lightning_determinism.metrics._native import NativeKernel, find_compiler

COMPILE_ENV = "LDET_PERPLEXITY_COMPILE"
"""``"1"``/``"0"`` forces the compiled kernel on or off where a metric's ``compile`` argument is ``None``."""

NATIVE_ENV = "LDET_PERPLEXITY_NATIVE"
"""``"0"`` keeps the compiled path on Inductor's kernel instead of the C kernel (set it before the first update)."""

COMPILE_MIN_VOCAB = 4096
"""With ``compile=None``, the kernel is compiled on CPU for vocabularies at least this large."""

FLOAT64_EXP_MAX_VOCAB = 4096
"""On CUDA, below this vocabulary size the eager path takes the exponentials in float64 (on CPU: always)."""

EXP_FLOOR = -87.0  # exp() below this is subnormal: ~35x slower on CPUs, and < 2e-38 of the row's sum
_CHUNK_BYTES_CPU = 2 * 2**20  # a chunk of float32 rows that stays in a CPU's L2/L3 cache (fastest measured)
_CHUNK_BYTES_CUDA = 256 * 2**20  # on a GPU, fewer and larger kernels win


def _row_stats(logits: Tensor, ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Row max, float64 sum of ``exp(x - max)`` and the target's logit; the body of the compiled kernel."""
    x = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    top = x.amax(dim=-1, keepdim=True)
    row_sum = torch.exp((x - top).clamp_min(EXP_FLOOR)).sum(dim=-1, dtype=torch.float64)
    picked = x.gather(-1, ids[:, None])
    return top.squeeze(-1), row_sum, picked.squeeze(-1)


class _CompiledKernel:
    """The compiled row statistics, built once per process.

    :mod:`._native`'s C kernel for CPU logits other than float64, Inductor's :func:`_row_stats` otherwise. A failure
    of the C kernel falls back to Inductor (warned once), a failure of Inductor to the eager path (warned once).
    """

    def __init__(self) -> None:
        self.fn: Any = None
        self.failed: str | None = None
        self.native = NativeKernel()
        self._warned_native = False

    def available(self) -> bool:
        return self.failed is None

    def __call__(self, logits: Tensor, ids: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
        """The row statistics, or ``None`` once compiling has failed in this process."""
        if self.failed is not None:
            return None
        if logits.device.type == "cpu" and logits.dtype != torch.float64 and os.environ.get(NATIVE_ENV) != "0":
            out = self.native(logits, ids)
            if out is not None:
                return out
            if not self._warned_native:
                self._warned_native = True
                warnings.warn(
                    f"building the perplexity's C kernel failed ({(self.native.failed or '')[:300]}); this process"
                    " uses the kernel torch.compile generates from now on (about half as fast; values agree to"
                    " float32 rounding, not bitwise).",
                    DeterminismWarning,
                    stacklevel=4,
                )
        try:
            if self.fn is None:
                self.fn = torch.compile(_row_stats, dynamic=False, fullgraph=True)
            # No size hint for the row count: one kernel for every batch size, no 0/1 specialisation.
            mark_unbacked(logits, 0)
            mark_unbacked(ids, 0)
            with warnings.catch_warnings():
                # Inductor's own use of deprecated torch.jit helpers is not the user's concern.
                warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.")
                out = self.fn(logits, ids)
        except Exception as err:  # noqa: BLE001  (any compiler, toolchain or tracing failure: fall back)
            lines = [line.strip() for line in str(err).splitlines() if line.strip()]
            self.failed = " ".join([f"{type(err).__name__}:", *lines[:2]])
            warnings.warn(
                f"compiling the perplexity kernel failed ({self.failed[:300]}); this process uses the eager path"
                " from now on (slower; values agree with the compiled path to float32 rounding, not bitwise).",
                DeterminismWarning,
                stacklevel=4,
            )
            return None
        return out


KERNEL = _CompiledKernel()


def _have_cxx() -> bool:
    return any(shutil.which(name) for name in (os.environ.get("CXX", "g++"), "g++", "c++", "clang++"))


def use_compiled(compile: bool | None, device: torch.device, vocab: int) -> bool:
    """Whether an update on ``device`` with ``vocab`` classes goes through the compiled kernel.

    ``compile=None`` reads :data:`COMPILE_ENV` and otherwise compiles on CPU for ``vocab >= 4096`` when a C or C++
    compiler is on the ``PATH``. The answer depends only on these, never on the batch: a metric keeps one path.

    Examples:
        >>> use_compiled(False, torch.device("cpu"), 32_000), use_compiled(None, torch.device("cpu"), 100)
        (False, False)
    """
    if compile is not None:
        return compile and KERNEL.available()
    env = os.environ.get(COMPILE_ENV)
    if env in ("0", "1"):
        return env == "1" and KERNEL.available()
    return device.type == "cpu" and vocab >= COMPILE_MIN_VOCAB and KERNEL.available() and _have_compiler()


def _have_compiler() -> bool:
    """A C or C++ compiler on the ``PATH`` (looked up once per ``PATH``, ``CC`` and ``CXX``: updates are hot)."""
    key = (os.environ.get("PATH"), os.environ.get("CC"), os.environ.get("CXX"))
    if key not in _COMPILER_SEEN:
        _COMPILER_SEEN[key] = _have_cxx() or find_compiler() is not None
    return _COMPILER_SEEN[key]


_COMPILER_SEEN: dict[tuple[str | None, ...], bool] = {}


def _chunk_rows(vocab: int, device: torch.device, chunk_size: int | None) -> int:
    if chunk_size is not None:
        return chunk_size
    budget = _CHUNK_BYTES_CUDA if device.type == "cuda" else _CHUNK_BYTES_CPU
    return max(1, budget // (4 * max(vocab, 1)))


def _eager_row_stats(logits: Tensor, ids: Tensor, chunk_size: int | None) -> tuple[Tensor, Tensor, Tensor]:
    """Row statistics one cache-sized chunk at a time: nothing of size ``N x V`` is allocated."""
    vocab = logits.shape[-1]
    n = logits.shape[0]
    work_dtype = torch.promote_types(logits.dtype, torch.float32)
    if vocab < FLOAT64_EXP_MAX_VOCAB or logits.device.type == "cpu":
        # float32 exponentials are biased (~1e-9 relative in the perplexity: their float32 argument reduction
        # rounds every logit with the same exponent alike, see _native); in float64 the eager path costs 1.26x
        # at V=32,000 on CPU, next to nothing on small vocabularies. On a GPU float64 is slow: large vocabularies
        # keep float32 there.
        work_dtype = torch.float64
    rows = _chunk_rows(vocab, logits.device, chunk_size)
    on_cpu = logits.device.type == "cpu"
    shifted = torch.empty((min(rows, n), vocab), dtype=work_dtype, device=logits.device)
    top = torch.empty((n, 1), dtype=work_dtype, device=logits.device)
    row_sum = torch.empty(n, dtype=torch.float64, device=logits.device)
    row_sum_np = row_sum.numpy() if on_cpu else None
    for start in range(0, n, rows):
        chunk = logits[start : start + rows]
        k = chunk.shape[0]
        y = shifted[:k]
        y.copy_(chunk)  # exact: upcasting or a plain copy
        torch.amax(y, dim=-1, keepdim=True, out=top[start : start + k])
        y.sub_(top[start : start + k]).clamp_(min=EXP_FLOOR)  # exact IEEE operations, whatever the threads
        if row_sum_np is not None:
            y_np = y.numpy()
            np.exp(y_np, out=y_np)
            np.add.reduce(y_np, axis=1, dtype=np.float64, out=row_sum_np[start : start + k])
        else:
            y.exp_()
            torch.sum(y, dim=-1, dtype=torch.float64, out=row_sum[start : start + k])
    picked = logits.gather(-1, ids[:, None]).to(work_dtype)
    return top.squeeze(-1), row_sum, picked.squeeze(-1)


def token_nll(logits: Tensor, ids: Tensor, compiled: bool = False, chunk_size: int | None = None) -> Tensor:
    """Per-token NLL (float64) of ``ids`` ``[N]`` under ``logits`` ``[N, V]``; never part of an autograd graph.

    Examples:
        >>> _ = torch.manual_seed(0)
        >>> logits, ids = torch.randn(5, 7), torch.randint(7, (5,))
        >>> ref = torch.nn.functional.cross_entropy(logits.double(), ids, reduction="none")
        >>> bool(torch.allclose(token_nll(logits, ids), ref, rtol=1e-6))
        True
    """
    with torch.no_grad():
        logits = logits.detach()
        stats = None
        if compiled and logits.shape[0] > 0:
            stats = KERNEL(logits.contiguous().view(logits.shape), ids.contiguous().view(ids.shape))
        if stats is None:
            stats = _eager_row_stats(logits, ids, chunk_size)
        top, row_sum, picked = stats
        gap = top.double() - picked.double()  # one IEEE subtraction: the same bits on any thread or position
        if row_sum.device.type == "cpu":
            return gap + torch.from_numpy(np.log(row_sum.numpy()))
        return gap + row_sum.log()


__all__ = ["COMPILE_ENV", "COMPILE_MIN_VOCAB", "KERNEL", "NATIVE_ENV", "token_nll", "use_compiled"]
