"""Matrix products in row tiles of probed sizes: a row's bits depend on its own values and the other operand only.

A BLAS picks its code path (micro-kernel, blocking, bias handling) from the shape it is handed, so a row of a product
gets other bits when the product has another number of rows. The kernels here, which
:func:`~lightning_determinism.invariance.batch_invariant.batch_invariant` registers over ATen's ``mm``, ``addmm``,
``bmm`` and ``baddbmm``, cut every product into tiles whose sizes are fixed:

- the reference tile has ``rows`` rows (:data:`~lightning_determinism.invariance.batch_invariant.DEFAULT_ROWS`), and is
  probed for rows whose bits do not depend on their position in it (a BLAS may split 7 rows as 4 + 3); where that
  fails, the next size that passes is the reference, with a ``DeterminismWarning``;
- another size (1 to 1,024 rows) is used only where a probe finds that it gives every row exactly the reference's bits:
  larger tiles save calls, smaller ones save padding (a batch of one pays for the smallest tile, not ``rows``);
- a product is cut largest tile first, its last rows padded with zero rows to the smallest tile that holds them;
- ``addmm`` keeps its fused bias where a probe finds it equal to the product followed by ``add_`` of the bias, and is
  computed as that sum elsewhere: ``nn.Linear`` takes one form or the other by its input's memory layout;
- a batched product hands the BLAS at least two entries, and two at a time where a probe finds the entry count
  matters.

Each probe runs once per shape, dtype, operand layout, tile and intra-op thread count, on random rows times the call's
own second operand (the BLAS picks its path from shapes and strides, never from the values): a few products of up to
2,049 rows, with no copy of the weight.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from lightning_determinism.errors import DeterminismWarning

ROWS: list[dict[str, int]] = []  # the reference tile by device type, of the modes entered (innermost last)

_MM_OUT = torch.ops.aten.mm.out
_BMM_OUT = torch.ops.aten.bmm.out


def _rows(device: torch.device) -> int:
    rows = ROWS[-1]
    return rows.get(device.type, rows["cpu"])


_CANDIDATES = (1024, 256, 64, 32, 16, 8, 4, 2, 1)  # tile sizes tried against the reference tile of `rows` rows
_PROBE_ROWS = 1024
_TILES: dict[tuple[Any, ...], tuple[int, ...]] = {}  # (operation, device, dtypes, K, N, layout, rows, threads) -> sizes


def _probe_operand(like: torch.Tensor, rows: int, cols: int, gen: torch.Generator, batch: int | None) -> torch.Tensor:
    shape = (rows, cols) if batch is None else (batch, rows, cols)
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(device=like.device, dtype=like.dtype)


def _tile_sizes(batched: bool, a: torch.Tensor, b: torch.Tensor, rows: int) -> tuple[int, ...]:
    """The tile sizes (largest first) whose rows get exactly the bits of ``rows``-row tiles, for this shape.

    ``rows``-row tiles are the reference: every product of the mode is computed in tiles of the sizes returned, and
    a size is among them only where random rows times the call's own second operand give each row exactly what
    ``rows``-row tiles give (the BLAS picks its path from the shapes, strides, dtype and thread count, never from the
    values; the probe's rows take at most ``2 * 1024 + 1`` rows of the first operand's width, once per key).
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
        y = b[:2] if batched else b  # the operand itself: its exact layout, and no copy of a weight (the BLAS's path
        # depends on shapes and strides, never on the values)

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


def _in_tiles(a: torch.Tensor, n: int, sizes: tuple[int, ...], product: Any) -> torch.Tensor:
    """``product(rows, out)`` over ``a``'s rows in the tiles of :func:`_plan` (the last padded with zero rows)."""
    m = a.shape[0]
    out = a.new_empty((m, n))
    if m in sizes:  # the common case (a batch of 4, 8, 16, ... rows): one call
        return product(a, out)
    for start, size in _plan(m, sizes):
        if start + size <= m:
            product(a[start : start + size], out[start : start + size])
        else:
            tail = a.new_zeros((size, a.shape[1]))
            tail[: m - start] = a[start:]
            out[start:] = product(tail, a.new_empty((size, n)))[: m - start]
    return out


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    m, n = a.shape[0], b.shape[1]
    if not a.is_floating_point() or m == 0:
        return torch.mm(a, b, out=a.new_empty((m, n)))
    if not a.is_contiguous():
        a = a.contiguous()  # one layout: a transposed operand takes other packing routines
    sizes = _tile_sizes(False, a, b, _rows(a.device))
    return _in_tiles(a, n, sizes, lambda rows, out: torch.mm(rows, b, out=out))


_ENTRIES: dict[tuple[Any, ...], bool] = {}  # (device, dtypes, K, N, layout, rows, threads) -> entry-count free


def _entries_free(a: torch.Tensor, b: torch.Tensor, rows: int) -> bool:
    """Whether a batched product's first two entries get the same bits alone and among (up to 17 of) the call's entries.

    Probed once per shape on the call's own operands; where not, the mode hands the BLAS two entries at a time.
    """
    k, n = a.shape[-1], b.shape[-1]
    key = (a.device, a.dtype, b.dtype, k, n, b.stride(-2) == 1, rows, torch.get_num_threads())
    free = _ENTRIES.get(key)
    if free is None:
        count = min(a.shape[0], 17)
        many = _BMM_OUT(a[:count], b[:count], out=a.new_empty((count, a.shape[1], n)))
        two = _BMM_OUT(a[:2], b[:2], out=a.new_empty((2, a.shape[1], n)))
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


def _fuses(a: torch.Tensor, b: torch.Tensor, sizes: tuple[int, ...]) -> bool:
    """Whether ``addmm`` with a row of bias gives the bits of the product followed by ``add_`` of the bias.

    Probed for this shape and every tile size, on random rows times the call's own ``b``: true where the BLAS reduces
    ``K`` in one block and adds the bias last. Where it does, the mode keeps the fused call (one pass fewer); elsewhere
    it adds the bias after the product.
    """
    gen = torch.Generator().manual_seed(1)
    n = b.shape[1]
    bias = _probe_operand(b, 1, n, gen, None)[0]
    for size in sizes:
        x = _probe_operand(a, size, a.shape[1], gen, None)
        fused = torch.addmm(bias, x, b, out=x.new_empty((size, n)))
        if not torch.equal(fused, torch.mm(x, b, out=x.new_empty((size, n))).add_(bias)):
            return False
    return True


_FUSED: dict[tuple[Any, ...], tuple[tuple[int, ...], bool]] = {}  # addmm's key -> (tile sizes, fused bias kept)


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
            return _in_tiles(a, n, sizes, lambda rows, out: torch.addmm(bias, rows, b, out=out))
    return _with_bias(_mm(a, b), bias, beta, alpha)


def _baddbmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: Any = 1, alpha: Any = 1) -> torch.Tensor:
    return _with_bias(_bmm(a, b), bias, beta, alpha)


OVERRIDES = {"mm": _mm, "addmm": _addmm, "bmm": _bmm, "baddbmm": _baddbmm}
"""The kernels registered over ATen's, by operator name."""
