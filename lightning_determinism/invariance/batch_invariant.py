"""Batch-invariant evaluation: a sample's outputs do not depend on its batch, the batch size, padding or the world size.

The metrics sum exactly, but the model's forward is not batch-invariant: kernels pick their code path by shape. Measured
on a 2-core AVX-512 CPU (torch 2.13, MKL 2024.2): a float32 matrix product gives other last bits for a row when the
matrix has 1-3, 5-7 or 9-11 rows; ``linear`` fuses the bias into the product (``addmm``) or adds it afterwards
(``mm`` then ``add_``) depending on the input's memory layout, which a GRU's input has one way at batch 1 and the other
way at batch 16; CPU attention kernels block the keys by the sequence length. So a sample's logits change with what
else is in its batch, and an evaluation's perplexity with the eval batch size and the number of processes (1e-10
relative in float32, 4e-5 under bf16 autocast, where one flipped bit is a bf16 step).

:func:`batch_invariant` makes every such kernel see one shape while it is on:

- ``mm``, ``addmm``, ``bmm`` and ``baddbmm`` (CPU, and CUDA where there is one) run in row tiles of exactly ``rows``
  rows (the last one padded with zero rows), the rows laid out contiguously: every product the BLAS computes has one
  row count, so a row's bits depend on its own values and the other operand only (no GEMM reduces across rows).
  ``addmm`` and ``baddbmm`` are computed as the product, then ``add_`` of the bias: the form ``linear`` takes for a
  non-contiguous input, so both of ``linear``'s forms give the same bits.
- ``scaled_dot_product_attention`` runs :func:`~lightning_determinism.invariance.attention.invariant_attention`:
  keys in fixed blocks with an online softmax, in which a block that is wholly masked (padding after a causal
  sample's end) changes nothing, bit for bit.
- ``nn.MultiheadAttention``'s fused fast path is off (its kernel has no row tiles): it takes the path above.

Everything else a forward does (elementwise ops, embedding, layer norm, softmax over a fixed dimension) computes
each row by itself, which the tests check bitwise for a GRU language model and a causal transformer, float32 and bf16
autocast, at eval batch sizes 1, 4 and 16 on 1, 2 and 3 processes. Not covered: convolutions, recurrent layers with
``num_layers > 1`` and dropout between them in train mode, and kernels of other libraries.

Cost (``benchmarks/batch_invariant.py``): the Python call per product (a few µs), the padding of the last tile and the
attention's Python loop over key blocks; no extra memory beyond one tile.

While it is on, the overrides hold for the whole process (they are registered with torch's dispatcher): evaluation is
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
from lightning_determinism.errors import DeterminismWarning
from lightning_determinism.invariance.attention import DEFAULT_KEY_BLOCK, invariant_attention, release_buffers

DEFAULT_ROWS = {"cpu": 16, "cuda": 128}
"""Rows per tile by device: 16 is the smallest row count from which MKL's float32 GEMM takes one path on the CPUs
measured; a GPU's GEMM tiles are larger (a 128-row tile wastes nothing there)."""

_ACTIVE: list[dict[str, Any]] = []  # the settings of the modes entered, innermost last
_STATE: dict[str, Any] = {"library": None, "fastpath": None, "function_mode": None}

_MM_OUT = torch.ops.aten.mm.out
_BMM_OUT = torch.ops.aten.bmm.out


def _rows(device: torch.device) -> int:
    rows: dict[str, int] = _ACTIVE[-1]["rows"]
    return rows.get(device.type, rows["cpu"])


_CANDIDATES = (1024, 256, 64, 32, 16, 8, 4, 2, 1)  # tile sizes tried against the reference tile of `rows` rows
_PROBE_ROWS = 1024
_TILES: dict[tuple[Any, ...], tuple[int, ...]] = {}  # (operation, device, dtypes, K, N, layout, rows, threads) -> sizes


def _layout(b: torch.Tensor) -> str:
    """How the second operand lies: the BLAS packs a transposed one (a weight's ``.t()``) with other routines."""
    return "t" if b.stride(-2) == 1 and b.shape[-1] > 1 else "n"


def _probe_operand(like: torch.Tensor, rows: int, cols: int, gen: torch.Generator, batch: int | None) -> torch.Tensor:
    shape = (rows, cols) if batch is None else (batch, rows, cols)
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(device=like.device, dtype=like.dtype)


def _tile_sizes(batched: bool, a: torch.Tensor, b: torch.Tensor, rows: int) -> tuple[int, ...]:
    """The tile sizes (largest first) whose rows get exactly the bits of ``rows``-row tiles, for this shape.

    ``rows``-row tiles are the reference: every product of the mode is computed in tiles of the sizes returned, and
    a size is among them only where a product of random operands of this shape, dtype, layout and thread count gives
    each of its rows exactly what ``rows``-row tiles give (the BLAS picks its path from those, never from the values).
    Larger tiles save calls; smaller ones save padding (batch 1 pays for one row, not ``rows``).
    """
    k, n = a.shape[-1], b.shape[-1]
    key = (batched, a.device, a.dtype, b.dtype, k, n, b.stride(-2) == 1, rows, torch.get_num_threads())
    sizes = _TILES.get(key)
    if sizes is None:
        gen = torch.Generator().manual_seed(0)
        entries = 2 if batched else None  # a batched product always has two entries or more (see _bmm)
        product = _BMM_OUT if batched else _MM_OUT
        candidates = sorted({*_CANDIDATES, rows})
        x = _probe_operand(a, 2 * max(_PROBE_ROWS, rows) + 1, k, gen, entries)
        y = _probe_operand(b, n, k, gen, entries).transpose(-2, -1)
        if _layout(b) == "n":
            y = y.contiguous()

        def tiled(size: int, count: int, first: int = 0) -> torch.Tensor:  # whole tiles of `size` rows
            parts = []
            for start in range(first, first + count, size):
                part = x[..., start : start + size, :]
                parts.append(product(part, y, out=part.new_empty((*part.shape[:-1], n))))
            return torch.cat(parts, dim=-2)

        # The reference tile: its rows' bits must not depend on their position in it (a BLAS may split 7 rows as
        # 4 + 3 with two kernels); where `rows` fails that here, the next candidate that passes takes its place.
        # `rows` first, then larger tiles, then smaller ones: one row alone always passes.
        order = [size for size in candidates if size >= rows] + [size for size in reversed(candidates) if size < rows]
        reference_rows = next(
            size for size in order
            if size == 1 or torch.equal(tiled(size, 2 * size)[..., 1 : 1 + size, :], tiled(size, size, first=1))
        )  # fmt: skip
        if reference_rows != rows:
            _warn_rows(rows, reference_rows, a)
        count_ref = reference_rows * -(-_PROBE_ROWS // reference_rows)
        reference = tiled(reference_rows, count_ref)
        usable = []
        for size in reversed(candidates):
            count = size * max(1, 64 // size)
            if size == reference_rows or (
                count <= count_ref and torch.equal(tiled(size, count), reference[..., :count, :])
            ):
                usable.append(size)
        sizes = _TILES[key] = tuple(usable)
    return sizes


def _warn_rows(rows: int, used: int, a: torch.Tensor) -> None:
    warnings.warn(
        f"batch_invariant(rows={rows}): on this {a.device.type} a {rows}-row product's rows depend on their position in"
        f" it ({a.dtype}, K={a.shape[-1]}): tiles of {used} row(s) are the reference instead"
        + (" (slower: one product per row)" if used == 1 else ""),
        DeterminismWarning,
        stacklevel=3,
    )


def _plan(m: int, sizes: tuple[int, ...]) -> list[tuple[int, int]]:
    """``(start, size)`` tiles covering ``m`` rows, largest first; the last may reach past ``m`` (zero rows padded)."""
    tiles, start = [], 0
    for size in sizes:
        while m - start >= size:
            tiles.append((start, size))
            start += size
    if start < m:
        tiles.append((start, min(size for size in sizes if size >= m - start)))
    return tiles


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    m, n = a.shape[0], b.shape[1]
    if not a.is_floating_point() or m == 0:
        return torch.mm(a, b, out=a.new_empty((m, n)))
    if not a.is_contiguous():
        a = a.contiguous()  # one layout: a transposed operand takes other packing routines
    out = a.new_empty((m, n))
    sizes = _tile_sizes(False, a, b, _rows(a.device))
    if m in sizes:  # the common case (a batch of 4, 8, 16, ... rows): one call
        return torch.mm(a, b, out=out)
    for start, size in _plan(m, sizes):
        if start + size <= m:
            torch.mm(a[start : start + size], b, out=out[start : start + size])
        else:  # the last rows, padded with zero rows to a whole tile
            tail = a.new_zeros((size, a.shape[1]))
            tail[: m - start] = a[start:]
            out[start:] = torch.mm(tail, b, out=a.new_empty((size, n)))[: m - start]
    return out


_ENTRIES: dict[tuple[Any, ...], bool] = {}  # (device, dtypes, K, N, layout, rows, threads) -> entry-count free


def _entries_free(a: torch.Tensor, b: torch.Tensor, rows: int) -> bool:
    """Whether a batched product's entries get the same bits in a batch of 2 entries and in one of 17.

    Probed once per shape; where not, the mode hands the BLAS two entries at a time.
    """
    k, n = a.shape[-1], b.shape[-1]
    key = (a.device, a.dtype, b.dtype, k, n, b.stride(-2) == 1, rows, torch.get_num_threads())
    free = _ENTRIES.get(key)
    if free is None:
        gen = torch.Generator().manual_seed(2)
        x = _probe_operand(a, 17 * rows, k, gen, None).view(17, rows, k)
        y = _probe_operand(b, 17 * n, k, gen, None).view(17, n, k).transpose(-2, -1)
        if b.stride(-2) != 1:
            y = y.contiguous()
        many = _BMM_OUT(x, y, out=x.new_empty((17, rows, n)))
        two = _BMM_OUT(x[:2], y[:2], out=x.new_empty((2, rows, n)))
        free = _ENTRIES[key] = torch.equal(many[:2], two)
    return free


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    batch, m, n = a.shape[0], a.shape[1], b.shape[2]
    if not a.is_floating_point() or m == 0 or batch == 0:
        return _BMM_OUT(a, b, out=a.new_empty((batch, m, n)))
    if batch == 1:  # a batch of one may take the plain GEMM's path: every call has at least two entries
        return _bmm(torch.cat((a, a)), b.expand(2, *b.shape[1:]))[:1]
    rows = _rows(a.device)
    if batch > 2 and not _entries_free(a, b, rows):
        pairs = [_bmm(a[i : i + 2], b[i : i + 2]) for i in range(0, batch - batch % 2, 2)]
        if batch % 2:
            pairs.append(_bmm(a[-2:], b[-2:])[1:])
        return torch.cat(pairs)
    a = a.contiguous()
    sizes = _tile_sizes(True, a, b, rows)
    if m in sizes:
        return _BMM_OUT(a, b, out=a.new_empty((batch, m, n)))
    parts = []
    for start, size in _plan(m, sizes):
        tile = a[:, start : start + size]
        if start + size > m:
            tile = torch.cat((tile, a.new_zeros((batch, start + size - m, a.shape[2]))), dim=1)
        parts.append(_BMM_OUT(tile, b, out=a.new_empty((batch, size, n))))
    out = torch.cat(parts, dim=1)
    return out if out.shape[1] == m else out[:, :m].contiguous()


def _with_bias(product: torch.Tensor, bias: torch.Tensor, beta: Any, alpha: Any) -> torch.Tensor:
    if alpha != 1:
        product.mul_(alpha)
    if beta == 0:  # addmm ignores the bias then, NaN included
        return product
    return product.add_(bias) if beta == 1 else product.add_(bias, alpha=beta)


_FUSES: dict[tuple[Any, ...], bool] = {}  # (device, dtype, K, N, layout, rows, threads) -> fused bias == added bias


def _fuses(a: torch.Tensor, b: torch.Tensor, sizes: tuple[int, ...]) -> bool:
    """Whether ``addmm`` with a row of bias gives the bits of the product followed by ``add_`` of the bias.

    Probed for this shape and every tile size: true where the BLAS reduces ``K`` in one block and adds the bias last.
    Where it does, the mode keeps the fused call (one pass fewer); elsewhere it adds the bias after the product.
    """
    k, n = a.shape[1], b.shape[1]
    key = (a.device, a.dtype, k, n, b.stride(0) == 1, sizes, torch.get_num_threads())
    fuses = _FUSES.get(key)
    if fuses is None:
        gen = torch.Generator().manual_seed(1)
        y = _probe_operand(b, n, k, gen, None).t()
        if b.stride(0) != 1:
            y = y.contiguous()
        bias = _probe_operand(b, 1, n, gen, None)[0]
        fuses = True
        for size in sizes:
            x = _probe_operand(a, size, k, gen, None)
            fused = torch.addmm(bias, x, y, out=x.new_empty((size, n)))
            fuses = fuses and torch.equal(fused, torch.mm(x, y, out=x.new_empty((size, n))).add_(bias))
        _FUSES[key] = fuses
    return fuses


_FUSED: dict[tuple[Any, ...], tuple[tuple[int, ...], bool]] = {}  # the fast path's cache: (tile sizes, fuses)


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: Any = 1, alpha: Any = 1) -> torch.Tensor:
    m, n = a.shape[0], b.shape[1]
    if beta == 1 and alpha == 1 and bias.dim() == 1 and a.is_floating_point() and m > 0:
        if not a.is_contiguous():
            a = a.contiguous()
        # Called at every step of a recurrent layer: one cache lookup decides (the probes run once per shape).
        rows = _rows(a.device)
        key = (a.device, a.dtype, b.dtype, a.shape[1], n, b.stride(0), rows, torch.get_num_threads())
        known = _FUSED.get(key)
        if known is None:
            sizes = _tile_sizes(False, a, b, rows)
            known = _FUSED[key] = (sizes, _fuses(a, b, sizes))
        sizes, fuses = known
        if fuses:
            out = a.new_empty((m, n))
            if m in sizes:  # the common case (a batch of 4, 8, 16, ... rows): one call
                return torch.addmm(bias, a, b, out=out)
            for start, size in _plan(m, sizes):
                if start + size <= m:
                    torch.addmm(bias, a[start : start + size], b, out=out[start : start + size])
                else:
                    tail = a.new_zeros((size, a.shape[1]))
                    tail[: m - start] = a[start:]
                    out[start:] = torch.addmm(bias, tail, b, out=a.new_empty((size, n)))[: m - start]
            return out
    return _with_bias(_mm(a, b), bias, beta, alpha)


def _baddbmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: Any = 1, alpha: Any = 1) -> torch.Tensor:
    return _with_bias(_bmm(a, b), bias, beta, alpha)


_OVERRIDES = {"mm": _mm, "addmm": _addmm, "bmm": _bmm, "baddbmm": _baddbmm}


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
            for name, kernel in _OVERRIDES.items():
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
    settings: dict[str, Any] = {
        "rows": dict(DEFAULT_ROWS) if rows is None else dict.fromkeys(DEFAULT_ROWS, rows),
        "key_block": key_block,
    }
    _ACTIVE.append(settings)
    if len(_ACTIVE) == 1:
        try:
            _turn_on()
        except BaseException:
            _ACTIVE.pop()
            _turn_off()
            raise
    try:
        yield
    finally:
        _ACTIVE.pop()
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
