"""Per-token negative log-likelihood with the same bits for a row whatever else is computed, and wherever.

``nll = (max - x_target) + log(sum(exp(x - max)))`` per row of logits ``[N, V]``, by the arithmetic of
:mod:`~lightning_determinism.metrics._portable`: IEEE operations that round once each (no fused multiply-add, no
library ``exp`` or ``log``), each exponential rounded once to an integer number of ``2**-52`` and a row's terms
summed as integers. Hence two guarantees:

- **batch invariance**: a row's bits do not depend on the rows that share its batch, on the thread count or on how
  rows are split among threads (integer sums have no order). This is what makes a metric identical on any world
  size; PyTorch's own float reductions do not give it.
- **one value on every path and CPU**: the C kernel (:mod:`~lightning_determinism.metrics._native`, the default on
  CPU for float32 and half-precision logits), Inductor's kernel compiled from
  :func:`~lightning_determinism.metrics._portable.row_sums` (float64 logits, ``LDET_PERPLEXITY_NATIVE=0``, a C kernel
  that did not build, CUDA with ``compile=True``), and the same function run eagerly (no compiler, ``compile=False``)
  give the same bits, on any x86-64 or ARM CPU.
"""

from __future__ import annotations

import os
import shutil
import warnings
from typing import Any

import torch
from torch import Tensor

from lightning_determinism._compat.checks import maybe_mark_dynamic
from lightning_determinism.errors import DeterminismWarning
from lightning_determinism.metrics._native import NativeKernel, find_compiler
from lightning_determinism.metrics._portable import log_fixed, row_sums_narrow, row_sums_wide, wide

COMPILE_ENV = "LDET_PERPLEXITY_COMPILE"
"""``"1"``/``"0"`` forces the compiled kernel on or off where a metric's ``compile`` argument is ``None``."""

NATIVE_ENV = "LDET_PERPLEXITY_NATIVE"
"""``"0"`` keeps the compiled path on Inductor's kernel instead of the C kernel (set it before the first update)."""

COMPILE_MIN_VOCAB = 4096
"""With ``compile=None``, the kernel is compiled on CPU for vocabularies at least this large."""

_CHUNK_BYTES_CPU = 2 * 2**20  # float32 rows per eager chunk: its ~10 temporaries stay within a CPU's caches
_CHUNK_BYTES_CUDA = 256 * 2**20  # on a GPU, fewer and larger kernels win

RowSums = tuple[Tensor, Tensor, Tensor, Tensor]  # row max, the row sum's two int64 pieces, the target's logit


def _narrow_and_target(logits: Tensor, ids: Tensor) -> RowSums:
    """Float32 exponentials' row sums and the target's logit: Inductor's kernel (its own graphs, one per dtype)."""
    top, sum_hi, sum_lo = row_sums_narrow(logits)
    return top, sum_hi, sum_lo, logits.gather(-1, ids[:, None]).squeeze(-1)


def _wide_and_target(logits: Tensor, ids: Tensor) -> RowSums:
    """:func:`_narrow_and_target` with float64 exponentials."""
    top, sum_hi, sum_lo = row_sums_wide(logits)
    return top, sum_hi, sum_lo, logits.gather(-1, ids[:, None]).squeeze(-1)


def _row_sums_and_target(logits: Tensor, ids: Tensor) -> RowSums:
    """The eager path's body: the compiled kernels' function for ``logits``'s dtype and vocabulary, run op by op."""
    body = _wide_and_target if wide(logits.dtype, logits.shape[-1]) else _narrow_and_target
    return body(logits, ids)


def nll_from_row_sums(top: Tensor, sum_hi: Tensor, sum_lo: Tensor, picked: Tensor) -> Tensor:
    """Per-token NLL (float64) from any kernel's row sums: ``(max - x_target) + log(S * 2**-52)``."""
    gap = top.double() - picked.double()  # one IEEE subtraction: the same bits on any thread or position
    return gap + log_fixed(sum_hi, sum_lo)


class _CompiledKernel:
    """The compiled row statistics, built once per process.

    :mod:`._native`'s C kernel for CPU float32 and half logits from 4,096 classes, Inductor's otherwise.
    A failure of the C kernel falls back to Inductor, a failure of Inductor to the eager path (each said once; the
    values stay the same).
    """

    def __init__(self) -> None:
        self.fns: dict[bool, Any] = {}  # wide -> Inductor's kernel
        self.failed: str | None = None
        self.native = NativeKernel()
        self._warned_native = False

    def available(self) -> bool:
        return self.failed is None

    def variant(self) -> str:
        """Which kernel CPU float32 updates from 4,096 classes use.

        The C kernel and how its loop is vectorised (``"C kernel (vector block, AVX2)"``), Inductor's kernel, or the
        eager path.
        """
        native = self.native.variant() if os.environ.get(NATIVE_ENV) != "0" else None
        if native is not None:
            return f"C kernel ({native})"
        return "Inductor's kernel" if self.failed is None else "eager path"

    def __call__(self, logits: Tensor, ids: Tensor) -> RowSums | None:
        """The row sums, or ``None`` once compiling has failed in this process."""
        if self.failed is not None:
            return None
        is_wide = wide(logits.dtype, logits.shape[-1])
        if logits.device.type == "cpu" and not is_wide and os.environ.get(NATIVE_ENV) != "0":
            out = self.native(logits, ids)
            if out is not None:
                return out
            if not self._warned_native:
                self._warned_native = True
                warnings.warn(
                    f"building the perplexity's C kernel failed ({(self.native.failed or '')[:300]}); this process"
                    " uses the kernel torch.compile generates from now on (slower; the same values).",
                    DeterminismWarning,
                    stacklevel=4,
                )
        try:
            fn = self.fns.get(is_wide)
            if fn is None:
                fn = self.fns[is_wide] = torch.compile(
                    _wide_and_target if is_wide else _narrow_and_target, dynamic=False, fullgraph=True
                )
            # Rows and vocabulary as sizes: no recompile per batch size or vocabulary (a few graphs per dtype at
            # most, for sizes 1), under the recompile limit. The bits are the same in every graph: integer sums.
            maybe_mark_dynamic(logits, 0)
            maybe_mark_dynamic(ids, 0)
            maybe_mark_dynamic(logits, 1)
            with warnings.catch_warnings():
                # Inductor's own use of deprecated torch.jit helpers is not the user's concern.
                warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.")
                out = fn(logits, ids)
        except Exception as err:  # noqa: BLE001  (any compiler, toolchain or tracing failure: fall back)
            lines = [line.strip() for line in str(err).splitlines() if line.strip()]
            self.failed = " ".join([f"{type(err).__name__}:", *lines[:2]])
            warnings.warn(
                f"compiling the perplexity kernel failed ({self.failed[:300]}); this process uses the eager path"
                " from now on (slower; the same values).",
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


def _eager_row_sums(logits: Tensor, ids: Tensor, chunk_size: int | None) -> RowSums:
    """:func:`_row_sums_and_target` one chunk of rows at a time: nothing of size ``N x V`` is allocated."""
    rows = _chunk_rows(logits.shape[-1], logits.device, chunk_size)
    parts = [_row_sums_and_target(logits[i : i + rows], ids[i : i + rows]) for i in range(0, logits.shape[0], rows)]
    if len(parts) == 1:
        return parts[0]
    return tuple(torch.cat(pieces) for pieces in zip(*parts, strict=True))  # type: ignore[return-value]


def token_nll(logits: Tensor, ids: Tensor, compiled: bool = False, chunk_size: int | None = None) -> Tensor:
    """Per-token NLL (float64) of ``ids`` ``[N]`` under ``logits`` ``[N, V]``; never part of an autograd graph.

    ``compiled`` and ``chunk_size`` choose how it is computed, never the value.

    Examples:
        >>> _ = torch.manual_seed(0)
        >>> logits, ids = torch.randn(5, 7), torch.randint(7, (5,))
        >>> ref = torch.nn.functional.cross_entropy(logits.double(), ids, reduction="none")
        >>> bool(torch.allclose(token_nll(logits, ids), ref, rtol=1e-6))
        True
    """
    with torch.no_grad():
        logits = logits.detach()
        if logits.shape[0] == 0:
            return torch.zeros(0, dtype=torch.float64, device=logits.device)
        stats = None
        if compiled:
            stats = KERNEL(logits.contiguous().view(logits.shape), ids.contiguous().view(ids.shape))
        if stats is None:
            stats = _eager_row_sums(logits, ids, chunk_size)
        return nll_from_row_sums(*stats)


__all__ = ["COMPILE_ENV", "COMPILE_MIN_VOCAB", "KERNEL", "NATIVE_ENV", "nll_from_row_sums", "token_nll", "use_compiled"]
