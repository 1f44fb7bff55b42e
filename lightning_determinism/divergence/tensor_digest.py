"""Tensor digests that do not depend on how a tensor is sharded, computed where it lives, shard by shard.

A tensor's digest is two 64-bit lanes; lane ``L`` is the sum, modulo 2**64, over its elements of

    mix(bits(x[i]) XOR (i * salt_L mod 2**64))

where ``i`` is the element's flat index in the *whole* tensor, ``bits`` its raw bits as an integer and ``mix`` the
splitmix64 finaliser, a bijection of 64-bit words. The sum does not care in which order, on which rank or in how
many pieces the terms are added, so a shard adds the terms of its own elements (their global indices are known from
its placements) and the shards' partial sums add up to the digest of the whole tensor: the same value on one
process, under FSDP2 (``Shard(0)`` chunks, uneven ones too), tensor parallel (``Shard(0)``, ``Shard(1)``), both
(``_StridedShard``), on CPU or a GPU, without gathering a parameter (memory: the shard plus a bounded chunk of
64-bit words). Only 16 bytes per tensor leave a device; ranks exchange the partial sums of all tensors in one
``all_gather``.

Exactness and collisions: one differing element always changes both lanes (its term is a bijection of its bits, the
other terms are unchanged). Two tensors of the same dtype and shape differing in several elements collide only if
their terms' differences cancel in both lanes; modelling ``mix`` as a random function, that happens with
probability about 2**-128 per pair of tensors (2**-64 per lane). Not a cryptographic hash: it detects accidents
(another reduction order, a dropped all-reduce), not an adversary. Throughput against hashlib's sha256:
``benchmarks/tensor_digest.py``.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_determinism._process import distributed
from lightning_determinism.divergence._digest_native import whole_lanes
from lightning_determinism.divergence.shard_positions import (
    Positions,
    global_index,
    is_dtensor,
    mesh_layout,
    owns,
    splits,
    without_partial,
)

_MASK = (1 << 64) - 1
_C1, _C2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's multipliers
SALTS = (0x9E3779B97F4A7C15, 0xD1B54A32D192ED03)  # one odd multiplier per lane: position i's key is i * salt
CHUNK = 1 << 17  # elements per pass: 64-bit temporaries of 1 MiB each (near the cache), whatever the size
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def signed_word(value: int) -> int:
    """A 64-bit word as the int64 torch stores."""
    value &= _MASK
    return value - (1 << 64) if value >> 63 else value


def float_word(value: float) -> int:
    """A float64's bits as a signed 64-bit word (to travel in an int64 tensor untouched)."""
    return int(struct.unpack("<q", struct.pack("<d", value))[0])


def word_float(word: int) -> float:
    """The float64 whose bits are ``word`` (the inverse of :func:`float_word`)."""
    return float(struct.unpack("<d", struct.pack("<q", word))[0])


def _mix_(z: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 words, in place (wrapping arithmetic): a bijection of each word."""
    for shift, multiplier in ((30, _C1), (27, _C2), (31, None)):
        torch.bitwise_right_shift(z, shift, out=scratch)  # arithmetic; the mask makes it logical
        scratch.bitwise_and_((1 << (64 - shift)) - 1)
        z.bitwise_xor_(scratch)
        if multiplier is not None:
            z.mul_(signed_word(multiplier))
    return z


def _mix_int(z: int) -> int:
    """The same finaliser on a python int (the reference for tests and small values)."""
    z &= _MASK
    z = ((z ^ (z >> 30)) * _C1) & _MASK
    z = ((z ^ (z >> 27)) * _C2) & _MASK
    return z ^ (z >> 31)


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values as a plain ``torch.Tensor`` with storage of its own (no copy of one that is plain).

    A tensor subclass (``AsyncCollectiveTensor``, the output of a ``RowwiseParallel`` module, whose collective may still
    be in flight; any other wrapper) has no data of its own to read: an ``AsyncCollectiveTensor`` is waited on, any
    other subclass is copied into a plain tensor through its own dispatch. ``DTensor`` s are digested shard by shard
    by the callers, never here.
    """
    tensor = tensor.detach()
    if type(tensor) is torch.Tensor:
        return tensor
    wait = getattr(tensor, "wait", None)
    if callable(wait):  # an AsyncCollectiveTensor: its collective done, its values plain
        tensor = wait()
    if type(tensor) is not torch.Tensor:
        copy = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
        copy.copy_(tensor)
        tensor = copy
    return tensor


def _words(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The elements' bits as a flat integer view (no copy of a contiguous tensor), and int64 words per element."""
    tensor = plain(tensor)
    if tensor.is_meta:
        raise ValueError("a meta tensor has no values to digest; digest it once it is materialised")
    if tensor.layout != torch.strided:
        tensor = tensor.to_dense()
    tensor = tensor.contiguous().reshape(-1)
    width = tensor.element_size()
    if width in _INT_OF_WIDTH:
        return tensor.view(_INT_OF_WIDTH[width]), 1
    return tensor.view(torch.int64), width // 8  # complex128: two words per element


def partial_sums(local: torch.Tensor, positions: Positions | None = None) -> tuple[int, int]:
    """The two lanes' sums (python ints mod 2**64) over ``local``'s elements at their global positions.

    ``positions`` defaults to the tensor being whole (element ``e`` at index ``e``). Memory: ``local`` itself (a copy
    if it is not contiguous) and a few 64-bit words per element of one chunk of :data:`CHUNK` elements.
    """
    words, per = _words(local)
    start = 0 if positions is None else positions.start
    if start is not None:  # whole, or one run of the whole tensor's elements: the C kernel (CPU)
        found = whole_lanes(words, start * per)
        if found is not None:
            return found
    sums = [0, 0]
    for start in range(0, words.numel(), CHUNK):
        chunk = words[start : start + CHUNK].to(torch.int64)
        element = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=chunk.device)
        if positions is None:
            index = element
        else:
            index = positions.of(element // per) * per + element % per
        z, scratch = torch.empty_like(chunk), torch.empty_like(chunk)
        for lane, salt in enumerate(SALTS):
            torch.mul(index, signed_word(salt), out=z)  # the position's key (a bijection of the position)
            z.bitwise_xor_(chunk)
            sums[lane] = (sums[lane] + int(_mix_(z, scratch).sum())) & _MASK  # int64 sums wrap: exact mod 2**64
    return sums[0], sums[1]


_BATCHES: dict[Any, tuple[torch.Tensor, ...]] = {}  # by device and sizes: positions, owners and buffers of a batch


def _small_whole_lanes(tensors: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """:func:`partial_sums` of whole tensors on one device, all in one pass (a dozen ops, not a dozen per tensor).

    Each tensor's words keep their own positions ``0 .. n - 1``; the terms are summed per tensor with an integer
    ``index_add_`` (wrapping, exact in any order).
    """
    words_of = [_words(t)[0] for t in tensors]
    device = words_of[0].device
    if device.type == "cpu":
        found = [whole_lanes(words) for words in words_of]  # the C kernel: one pass per tensor
        if all(lanes is not None for lanes in found):
            return found  # type: ignore[return-value]
    layout = (str(device), tuple(w.numel() for w in words_of))
    cached = _BATCHES.get(layout)
    if cached is None:  # a model's parameters (or gradients) come in the same sizes every step
        counts = torch.tensor(layout[1], dtype=torch.int64, device=device)
        owner = torch.repeat_interleave(torch.arange(len(tensors), device=device), counts)
        starts = torch.cumsum(counts, 0) - counts
        index = torch.arange(int(counts.sum()), dtype=torch.int64, device=device) - starts[owner]
        salts = torch.tensor([signed_word(salt) for salt in SALTS], dtype=torch.int64, device=device)
        keys = index[None, :] * salts[:, None]  # both lanes' position keys, [2, n]: the same every step
        if len(_BATCHES) >= 64:
            _BATCHES.clear()
        cached = _BATCHES[layout] = (owner, keys, torch.empty_like(index), torch.empty_like(keys),
                                     torch.empty_like(keys))  # fmt: skip
    owner, keys, words, z, scratch = cached
    torch.cat([w.to(torch.int64) for w in words_of], out=words)
    torch.bitwise_xor(keys, words, out=z)  # both lanes in one pass of each operation
    sums = torch.zeros((2, len(tensors)), dtype=torch.int64, device=device).index_add_(1, owner, _mix_(z, scratch))
    first, second = sums.tolist()
    return [(a & _MASK, b & _MASK) for a, b in zip(first, second, strict=True)]


def combine(parts: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The lanes of a tensor from the partial sums of its shards (each element counted in exactly one)."""
    return sum(p[0] for p in parts) & _MASK, sum(p[1] for p in parts) & _MASK


def hex_digest(lanes: tuple[int, int]) -> str:
    """Two lanes as 32 hex digits."""
    return f"{lanes[0]:016x}{lanes[1]:016x}"


def shard_lanes(tensor: Any) -> tuple[int, int]:
    """This rank's part of ``tensor``'s lanes, on every replica (no communication).

    A ``DTensor``: its local shard at its global positions (``Partial`` values as they are); a plain tensor: whole.
    """
    if not is_dtensor(tensor):
        return partial_sums(tensor)
    from lightning_determinism._compat.access import dtensor_local

    local = dtensor_local(tensor)
    if not any(splits(p) for p in tensor.placements):
        return partial_sums(local)
    return partial_sums(local, global_index(tensor))


def local_lanes(tensor: Any) -> tuple[int, int]:
    """This rank's partial sums of ``tensor`` (a ``DTensor``: its shard, zero on replicas; else the whole)."""
    if not is_dtensor(tensor):
        return partial_sums(tensor)
    tensor = without_partial(tensor)
    return shard_lanes(tensor) if owns(tensor) else (0, 0)


def _local_parts(tensors: Sequence[torch.Tensor], local: Any) -> list[Any]:
    """Each tensor's ``local(part)``: a ``DTensor``'s shard on its owner, ``None`` on its other replicas."""
    from lightning_determinism._compat.access import dtensor_local

    parts = []
    for tensor in tensors:
        tensor = without_partial(tensor)
        if not is_dtensor(tensor):
            parts.append(local(tensor))
        elif owns(tensor):
            parts.append(local(dtensor_local(tensor)))
        else:
            parts.append(None)
    return parts


def mesh_ranks(tensor: Any) -> list[int]:
    """The global ranks of a ``DTensor``'s device mesh, in the mesh's order (the ranks whose parts make it whole)."""
    return list(mesh_layout(getattr(tensor, "device_mesh"))[1])  # noqa: B009  (a DTensor's; torch.Tensor has none)


def gather_words(rows: list[list[int]], width: int) -> list[list[list[int]]]:
    """Every rank's ``rows`` of ``width`` int64 words each (the same count on every rank), by global rank.

    One ``all_gather`` (on the GPU under NCCL); ``[rows]`` without a process group of more than one rank.
    """
    if not distributed():
        return [rows]
    mine = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), width)
    if "nccl" in str(dist.get_backend()):
        mine = mine.cuda()
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return [g.cpu().tolist() for g in gathered]


def _combined_over_meshes(tensors: Sequence[torch.Tensor], rows: list[list[int]]) -> list[list[list[int]]]:
    """All-gather each tensor's row of int64 words (one collective for all); per tensor, its mesh's ranks' rows.

    A plain tensor, or any without a process group: only this rank's row.
    """
    sharded = [i for i, t in enumerate(tensors) if is_dtensor(t)]
    out = [[row] for row in rows]
    if not sharded or not distributed():
        return out
    gathered = gather_words([rows[i] for i in sharded], len(rows[sharded[0]]))
    for row, i in enumerate(sharded):
        out[i] = [gathered[r][row] for r in mesh_ranks(tensors[i])]
    return out


def local_square_sums(tensors: Sequence[torch.Tensor]) -> list[float]:
    """Each tensor's sum of squares on this rank, in float64 (no communication).

    A plain tensor's whole; a ``DTensor``'s shard on its owners and ``0.0`` on its other replicas, so that the sum
    over its mesh's ranks is the whole tensor's.
    """

    def squares(t: torch.Tensor) -> float:
        return float(t.detach().double().square().sum())

    return [p if p is not None else 0.0 for p in _local_parts(tensors, squares)]


def full_norms(tensors: Sequence[torch.Tensor | None]) -> list[float | None]:
    """The 2-norm of each whole tensor; ``None`` for ``None`` (a parameter without a gradient).

    A ``DTensor``'s without gathering it: its owners' float64 sums of squares, combined over its mesh (one collective
    for all).

    Examples:
        >>> full_norms([torch.tensor([3.0, 4.0]), None])
        [5.0, None]
    """
    present = [t for t in tensors if t is not None]
    rows = [[float_word(p)] for p in local_square_sums(present)]
    combined = _combined_over_meshes(present, rows)
    values = iter(math.sqrt(math.fsum(word_float(r[0]) for r in rows_of)) for rows_of in combined)
    return [next(values) if t is not None else None for t in tensors]


def local_digest_lanes(tensors: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """Each tensor's lanes on this rank (no communication).

    A plain tensor's whole; a ``DTensor``'s shard's partial sums on its owners and ``(0, 0)`` on its other replicas
    (:func:`combine` over its mesh's ranks: the whole tensor's).
    """
    lanes: list[tuple[int, int] | None] = [None] * len(tensors)
    small: dict[Any, list[int]] = {}  # plain tensors of at most a chunk, by device: one pass for each device
    for i, tensor in enumerate(tensors):
        if (
            not is_dtensor(tensor)
            and tensor.layout == torch.strided
            and tensor.numel() * max(tensor.element_size() // 8, 1) <= CHUNK
        ):
            small.setdefault(tensor.device, []).append(i)
        else:
            lanes[i] = local_lanes(tensor)
    for members in small.values():
        for i, lane in zip(members, _small_whole_lanes([tensors[i] for i in members]), strict=True):
            lanes[i] = lane
    return lanes  # type: ignore[return-value]  # every one filled


def digests(tensors: Sequence[torch.Tensor]) -> list[str]:
    """The digest of each tensor (32 hex digits); with ``DTensor``s among them a collective: call it on every rank.

    Sharded tensors are combined over the ranks of their device mesh, in one ``all_gather`` for all of them.

    Examples:
        >>> x = torch.arange(6.0).reshape(2, 3)
        >>> digests([x])[0] == digests([x.clone()])[0], digests([x])[0] == digests([x.T.contiguous().T])[0]
        (True, True)
        >>> digests([x])[0] == digests([x.reshape(3, 2)])[0]  # the flat order only: add dtype and shape beside it
        True
    """
    rows = [[signed_word(lane[0]), signed_word(lane[1])] for lane in local_digest_lanes(tensors)]
    combined = _combined_over_meshes(tensors, rows)
    return [hex_digest(combine([(r[0], r[1]) for r in rows_of])) for rows_of in combined]


def digest_of(tensor: torch.Tensor) -> str:
    """One tensor's digest (see :func:`digests`; a collective for a ``DTensor``)."""
    return digests([tensor])[0]


def reference_digest(tensor: torch.Tensor) -> str:
    """The digest computed element by element in python (slow; the independent reference for tests)."""
    words, per = _words(tensor)
    lanes = [0, 0]
    for position, word in enumerate(words.tolist()):
        for lane, salt in enumerate(SALTS):
            key = (position * salt) & _MASK
            lanes[lane] = (lanes[lane] + _mix_int((word & _MASK) ^ key)) & _MASK
    del per
    return hex_digest((lanes[0], lanes[1]))


__all__ = [
    "CHUNK",
    "Positions",
    "SALTS",
    "combine",
    "digest_of",
    "digests",
    "float_word",
    "full_norms",
    "gather_words",
    "hex_digest",
    "is_dtensor",
    "local_digest_lanes",
    "local_lanes",
    "local_square_sums",
    "mesh_ranks",
    "owns",
    "partial_sums",
    "plain",
    "shard_lanes",
    "signed_word",
    "reference_digest",
    "word_float",
]
