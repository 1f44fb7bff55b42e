"""Batch-invariant evaluation: a sample's outputs do not depend on its batch, the batch size, padding or the world size.

The metrics sum exactly, but the model's forward is not batch-invariant: kernels pick their code path by shape. Measured
on a 2-core AVX-512 CPU (torch 2.13, MKL 2024.2): a float32 matrix product gives other last bits for a row when the
matrix has 1-3, 5-7 or 9-11 rows; ``linear`` fuses the bias into the product (``addmm``) or adds it afterwards
(``mm`` then ``add_``) depending on the input's memory layout, which a GRU's input has one way at batch 1 and the other
way at larger batches; CPU attention kernels block the keys by the sequence length. So a sample's logits change with
what else is in its batch, and an evaluation's perplexity with the eval batch size and the number of processes (7e-10
to 9e-10 relative in float32, 1e-5 under bf16 autocast, where one flipped bit is a bf16 step).

:func:`batch_invariant` makes every such kernel see shapes it gives the same bits in, while it is on:

- ``mm``, ``addmm``, ``bmm`` and ``baddbmm`` (CPU, and CUDA where there is one) run in row tiles of probed sizes
  (:mod:`~lightning_determinism.invariance.tiles`): a row's bits depend on its own values and the other operand only,
  and both forms of ``linear`` give the same bits;
- ``F.scaled_dot_product_attention`` runs :func:`~lightning_determinism.invariance.attention.invariant_attention`
  (keys in fixed blocks, an online softmax in which a block wholly masked for a query changes nothing, bit for bit);
- ``nn.MultiheadAttention``'s fused fast path is off, so that it takes the path above.

Everything else a forward does (elementwise ops, embedding, layer norm, softmax over a fixed dimension) computes
each row by itself, which the tests check bitwise for a GRU language model and a causal transformer, float32 and bf16
autocast, at eval batch sizes 1, 4 and 16 on 1, 2 and 3 processes. Not covered: convolutions, recurrent layers with
``num_layers > 1``, ``torch.compile``d models, and kernels of other libraries.

Cost (``benchmarks/batch_invariant.py``): a Python call per product (about 6 µs), the padding of a small batch to the
smallest probed tile, an attention of about ten operations per key block: 1.0x-1.2x stock on the CPU measured for a
GRU of width 512 and a 4-block transformer of width 256 at eval batch 4 and 16, up to 2.9x at eval batch 1 in float32.

While it is on, the kernels hold for the whole process (they are registered with torch's dispatcher): evaluation is
the only thing running in the Lightning loops that turn it on. Nesting is allowed.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from lightning_determinism._compat.checks import require
from lightning_determinism._compat.features import BATCH_INVARIANT
from lightning_determinism._compat.operators import destroy_library
from lightning_determinism.invariance.attention import DEFAULT_KEY_BLOCK, invariant_attention, release_buffers
from lightning_determinism.invariance.tiles import OVERRIDES, ROWS

DEFAULT_ROWS = {"cpu": 16, "cuda": 128}
"""Rows per tile by device: 16 is the smallest row count from which MKL's float32 GEMM takes one path on the CPUs
measured; a GPU's GEMM tiles are larger (a 128-row tile wastes nothing there)."""

_ACTIVE: list[dict[str, Any]] = []  # the settings of the modes entered, innermost last
_STATE: dict[str, Any] = {"library": None, "fastpath": None, "function_mode": None}


class _AttentionRouting(TorchFunctionMode):
    """Send ``F.scaled_dot_product_attention`` to the batch-invariant attention while the mode is on."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            return invariant_attention(*args, key_block=_ACTIVE[-1]["key_block"], **kwargs)
        return func(*args, **kwargs)


def _devices() -> list[str]:
    return ["CPU", "CUDA"] if torch.cuda.is_available() else ["CPU"]


def _turn_on() -> None:
    library = torch.library.Library("aten", "IMPL")  # noqa: TOR901 (overrides of existing kernels, on purpose)
    with warnings.catch_warnings():  # "Overriding a previously registered kernel": that is the point
        warnings.simplefilter("ignore")
        for key in _devices():
            for name, kernel in OVERRIDES.items():
                library.impl(name, kernel, key)
    _STATE["library"] = library
    _STATE["fastpath"] = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    mode = _AttentionRouting()
    mode.__enter__()
    _STATE["function_mode"] = mode


def _turn_off() -> None:
    mode, _STATE["function_mode"] = _STATE["function_mode"], None
    if mode is not None:
        mode.__exit__(None, None, None)
    torch.backends.mha.set_fastpath_enabled(bool(_STATE["fastpath"]))
    library, _STATE["library"] = _STATE["library"], None
    if library is not None:
        destroy_library(library)
    release_buffers()


def _check(name: str, value: int | None, low: int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an int, got {type(value).__name__} {value!r}")
    if value < low:
        raise ValueError(f"`{name}` must be at least {low}, got {value}")


@contextmanager
def batch_invariant(rows: int | None = None, key_block: int = DEFAULT_KEY_BLOCK) -> Iterator[None]:
    """Compute every sample's outputs independently of its batch, for the length of a block.

    Args:
        rows: rows per matrix-product tile; default 16 on CPU and 128 on CUDA (:data:`DEFAULT_ROWS`). Outputs agree
            bitwise between runs with the same ``rows``, whatever the batch.
        key_block: keys per attention block (:func:`~lightning_determinism.invariance.attention.invariant_attention`).

    Raises:
        TypeError: if ``rows`` or ``key_block`` is not an int.
        ValueError: if ``rows`` or ``key_block`` is below 1.

    The deterministic strategies turn it on for their evaluation loops with ``batch_invariant=True``.

    Examples:
        >>> import torch
        >>> _ = torch.manual_seed(0)
        >>> layer, x = torch.nn.Linear(512, 512), torch.randn(16, 512)
        >>> with torch.no_grad(), batch_invariant():
        ...     alone, together = layer(x[:1]), layer(x)
        >>> torch.equal(alone[0], together[0])
        True
    """
    _check("rows", rows, 1)
    _check("key_block", key_block, 1)
    require(BATCH_INVARIANT)
    _ACTIVE.append({"key_block": key_block})
    ROWS.append(dict(DEFAULT_ROWS) if rows is None else dict.fromkeys(DEFAULT_ROWS, rows))
    if len(_ACTIVE) == 1:
        try:
            _turn_on()
        except BaseException:
            _ACTIVE.pop()
            ROWS.pop()
            _turn_off()
            raise
    try:
        yield
    finally:
        _ACTIVE.pop()
        ROWS.pop()
        if not _ACTIVE:
            _turn_off()


def batch_invariant_enabled() -> bool:
    """Whether :func:`batch_invariant` is on in this process.

    Examples:
        >>> batch_invariant_enabled()
        False
        >>> with batch_invariant():
        ...     batch_invariant_enabled()
        True
    """
    return bool(_ACTIVE)
