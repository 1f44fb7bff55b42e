"""Attention whose output for a query does not depend on the batch, the number of heads batched, or trailing padding.

A fused attention kernel blocks the keys by the sequence length and the rows by the batch: the same query over the
same keys gets other bits when its batch is padded longer or holds more samples. :func:`invariant_attention` computes
scaled dot-product attention from pieces of one shape each: the keys in blocks of ``key_block`` (the last one padded
with masked keys), the query rows in the matrix-product tiles of
:func:`~lightning_determinism.invariance.batch_invariant.batch_invariant`, and an online softmax over the blocks in
their order. A block in which every key is masked for a query (the padding after a causal sample's end, the keys
beyond a short sequence) leaves that query's running maximum, sum and output exactly as they were (``exp(0) = 1``,
``exp(-inf) = 0``), so padding never moves a bit. Half-precision inputs are computed in float32 (an exact widening)
and the output rounded back once.

Cost: one pass over the keys per block, as a flash kernel makes, in Python: a few µs per block and layer. Memory: the
entries (batch x heads) are attended in chunks whose float32 working set (the widened queries, keys and values, one
block of scores) stays near 64 MiB, whatever the eval batch and the context length.
"""

from __future__ import annotations

import math
from typing import Any

import torch

_INF = math.inf
_CHUNK_FLOATS = 1 << 24  # float32 elements of one chunk of entries' working set (64 MiB)
DEFAULT_KEY_BLOCK = 64
"""Keys per block: short evaluation sequences take one block, long ones a loop of few iterations."""


_MASKS: dict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor]] = {}  # causal and padding masks of a block
_SPACE: dict[tuple[object, ...], torch.Tensor] = {}  # scratch buffers by shape: a fresh one costs its page faults


def release_buffers() -> None:
    """Drop the cached masks and scratch buffers (the mode calls it when it turns off)."""
    _MASKS.clear()
    _SPACE.clear()


def _scratch(like: torch.Tensor) -> torch.Tensor:
    key = (tuple(like.shape), like.dtype, like.device)
    space = _SPACE.get(key)
    if space is None:
        if len(_SPACE) > 8:
            _SPACE.clear()
        space = _SPACE[key] = torch.empty_like(like)
    return space


class _Masks:
    """The masks of one chunk of entries, made a block of keys at a time (never ``(B, L, S)`` at once).

    ``user`` is the caller's ``attn_mask`` broadcast to ``(*batch, L, S)`` (a view: nothing copied), ``rows`` the
    chunk's entries as indices into ``batch``. For a block, :meth:`block` gives ``(hide, keep, added)``: ``-inf``
    where a key takes no part (added before the maximum), its ``0``/``1`` weight (multiplied after the exponential),
    and the caller's additive float mask; padded keys (past ``S``) take no part. Causal and padding masks, the same for
    every entry, are cached by shape.
    """

    def __init__(self, user: torch.Tensor | None, rows: tuple[torch.Tensor, ...], causal: bool, length: int, keys: int):
        self.user, self.rows, self.causal, self.length, self.keys = user, rows, causal, length, keys

    def block(self, start: int, stop: int, device: torch.device) -> tuple[Any, Any, Any]:
        blocked = added = None
        if self.user is not None:
            index: tuple[Any, ...] = (*self.rows, slice(None), slice(start, min(stop, self.keys)))
            piece = self.user[index]  # (chunk, L, <= C): this chunk's entries and block only
            missing = stop - start - piece.shape[-1]
            if missing:  # keys past S: False (bool) or 0 (float); the padding mask hides them either way
                piece = torch.cat((piece, piece.new_zeros((*piece.shape[:-1], missing))), dim=-1)
            if piece.dtype == torch.bool:
                blocked = ~piece
            else:
                added = piece.float()
        shared = self._shared(start, stop, device)
        if blocked is None:
            return (*shared, added) if shared is not None else (None, None, added)
        if shared is not None:
            blocked = blocked | (shared[1] == 0)
        return torch.zeros(blocked.shape, device=device).masked_fill_(blocked, -_INF), (~blocked).float(), added

    def _shared(self, start: int, stop: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(hide, keep)`` of the causal rule and the padded keys, ``(1, L, C)``; ``None`` where neither applies."""
        if not self.causal and stop <= self.keys:
            return None
        key = (self.causal, self.length, self.keys, start, stop, device)
        found = _MASKS.get(key)
        if found is None:
            columns = torch.arange(start, stop, device=device)
            blocked = (columns >= self.keys).expand(self.length, -1)
            if self.causal:  # torch's convention: key j takes part for query i when j <= i
                blocked = blocked | (columns.unsqueeze(0) > torch.arange(self.length, device=device).unsqueeze(1))
            blocked = blocked.unsqueeze(0)
            if len(_MASKS) > 256:
                _MASKS.clear()
            found = _MASKS[key] = (
                torch.zeros(blocked.shape, device=device).masked_fill_(blocked, -_INF),
                (~blocked).float(),
            )
        return found


def _widened(tensor: torch.Tensor) -> torch.Tensor:
    """A new contiguous copy, float32 or wider (a half-precision tensor is widened, exactly, on the way)."""
    wide = torch.float32 if tensor.dtype in (torch.float16, torch.bfloat16) else tensor.dtype
    out = torch.empty(tensor.shape, dtype=wide, device=tensor.device)
    return out.copy_(tensor)


def invariant_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    key_block: int = DEFAULT_KEY_BLOCK,
) -> torch.Tensor:
    """Scaled dot-product attention, as ``F.scaled_dot_product_attention`` takes it, computed batch-invariantly.

    Args:
        query: ``(..., L, E)``.
        key: ``(..., S, E)``.
        value: ``(..., S, Ev)``.
        attn_mask: boolean (``True`` takes part) or additive, broadcastable to ``(..., L, S)``.
        dropout_p: must be 0: evaluation draws no attention dropout here.
        is_causal: mask key ``j`` for query ``i`` when ``j > i``.
        scale: the scores' factor; default ``1 / sqrt(E)``.
        enable_gqa: repeat the key and value heads to the query's (grouped-query attention).
        key_block: keys per block.

    Returns:
        ``(..., L, Ev)`` in the query's dtype.

    Raises:
        ValueError: if ``dropout_p`` is not 0, or ``attn_mask`` and ``is_causal`` are both given.

    Examples:
        >>> import torch
        >>> _ = torch.manual_seed(0)
        >>> q, k, v = torch.randn(3, 2, 5, 8), torch.randn(3, 2, 5, 8), torch.randn(3, 2, 5, 8)
        >>> out = invariant_attention(q, k, v, is_causal=True)
        >>> ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        >>> torch.allclose(out, ref, atol=1e-6)
        True
    """
    if dropout_p != 0:
        raise ValueError(f"batch-invariant attention draws no dropout: `dropout_p` must be 0, got {dropout_p}")
    if attn_mask is not None and is_causal:
        raise ValueError("`attn_mask` and `is_causal` cannot both be given (as in F.scaled_dot_product_attention)")
    with torch.autocast(query.device.type, enabled=False):  # float32 inside: autocast would cast the products back
        return _attention(query, key, value, attn_mask, is_causal, scale, enable_gqa, key_block).to(query.dtype)


def _attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    key_block: int,
) -> torch.Tensor:
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        key = key.repeat_interleave(query.shape[-3] // key.shape[-3], dim=-3)
        value = value.repeat_interleave(query.shape[-3] // value.shape[-3], dim=-3)
    length, keys, width = query.shape[-2], key.shape[-2], value.shape[-1]
    batch = tuple(torch.broadcast_shapes(query.shape[:-2], key.shape[:-2], value.shape[:-2]))
    blocks = max(1, -(-keys // key_block))
    padded = blocks * key_block
    user = None if attn_mask is None else attn_mask.expand(*batch, length, keys)  # a view
    q, k, v = (t.expand(*batch, *t.shape[-2:]).reshape(-1, *t.shape[-2:]) for t in (query, key, value))
    factor = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    # Entries (batch x heads) in chunks: the float32 working set stays near _CHUNK_FLOATS whatever the batch and the
    # context (a sample's bits do not depend on its chunk: entries are independent, and the products see to the count).
    per_entry = length * (q.shape[-1] + 3 * key_block + width) + padded * (k.shape[-1] + width)
    chunk = max(1, _CHUNK_FLOATS // per_entry)
    parts = []
    for lo in range(0, q.shape[0], chunk):
        part = slice(lo, lo + chunk)
        rows: tuple[torch.Tensor, ...] = ()
        if user is not None and batch:  # the chunk's entries as indices into the batch, to pick their mask rows
            entries = torch.arange(lo, min(lo + chunk, q.shape[0]), device=query.device)
            rows = tuple(torch.unravel_index(entries, batch))
        masks = _Masks(user, rows, is_causal, length, keys)
        parts.append(_attend(q[part], k[part], v[part], masks, factor, padded, key_block))
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out.reshape(*batch, length, width)


def _attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    masks: _Masks,
    factor: float,
    padded: int,
    key_block: int,
) -> torch.Tensor:
    """One chunk of entries: ``(n, L, E)`` queries over ``(n, S, E)`` keys, blockwise; ``(n, L, Ev)`` in float32."""
    q, k, v = _widened(query).mul_(factor), _widened(key), _widened(value)
    keys, width = k.shape[1], v.shape[2]
    if padded > keys:
        k = torch.cat((k, k.new_zeros((k.shape[0], padded - keys, k.shape[2]))), dim=1)
        v = torch.cat((v, v.new_zeros((v.shape[0], padded - keys, width))), dim=1)
    best = total = out = None
    for start in range(0, padded, key_block):
        stop = start + key_block
        scores = torch.bmm(q, k[:, start:stop].transpose(1, 2))
        hide, keep, added = masks.block(start, stop, q.device)
        if added is not None:
            scores = scores + added
        # Masked keys: out of the maximum, and a weight of exactly 0 (no exponential of -inf: a slow path).
        if hide is None:
            ranked = scores
        else:
            ranked = torch.add(scores, hide, out=_scratch(scores))
        top = ranked.amax(dim=-1, keepdim=True)
        new_best = top if best is None else torch.maximum(best, top)
        shift = torch.where(torch.isinf(new_best), 0.0, new_best)  # every key masked so far: 0
        weights = scores.sub_(shift).clamp_(max=0.0).exp_()  # in place; a masked key's raw score may exceed the max
        if keep is not None:
            weights.mul_(keep)
        mass, mixed = weights.sum(dim=-1, keepdim=True), torch.bmm(weights, v[:, start:stop])
        if best is None or total is None or out is None:  # the first block: nothing to rescale
            total, out = mass, mixed
        else:
            decay = torch.exp(best - shift)
            total, out = total * decay + mass, out * decay + mixed
        best = new_best
    assert out is not None and total is not None
    return out.div_(total)
