"""The digest's lanes of a whole CPU tensor in C: one pass over its words instead of a dozen torch passes.

The same arithmetic as :func:`~lightning_determinism.divergence.tensor_digest.partial_sums` for a tensor held whole
or a run of it (word ``i`` of the run at position ``start + i``: an FSDP2 chunk): each word widened to 64 bits as
torch's ``.to(torch.int64)`` widens it (uint8 zero-extended, int16 and int32 sign-extended), ``mix(word ^ position
* salt)`` summed modulo 2**64 per lane. Integer arithmetic only, so the lanes are the torch path's bit for bit
(tested) on any compiler or CPU; only the speed differs (the figures: ``benchmarks/tensor_digest.py``,
``benchmarks/baseline_recorder.py``).

Built once per machine with the C compiler on the ``PATH``, cached beside the perplexity's kernel
(:mod:`lightning_determinism.metrics._native`); without a compiler, or if building fails, the torch path is used.
"""

from __future__ import annotations

import ctypes

import torch

from lightning_determinism.metrics._native import LazyLibrary

SOURCE = r"""
#include <stdint.h>

static inline uint64_t mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

#define LANES(TYPE, WIDEN)                                                          \
    for (int64_t i = 0; i < n; i++) {                                               \
        uint64_t w = (uint64_t)(WIDEN)((const TYPE *)data)[i], k = start + i;       \
        s0 += mix(w ^ (k * 0x9E3779B97F4A7C15ULL));                                 \
        s1 += mix(w ^ (k * 0xD1B54A32D192ED03ULL));                                 \
    }

/* sums[0], sums[1]: the two lanes over n words of `width` bytes, word i at position start + i. */
void ldet_digest_lanes(const void *data, int64_t n, int width, uint64_t start, uint64_t *sums) {
    uint64_t s0 = 0, s1 = 0;
    if (width == 1) { LANES(uint8_t, uint64_t) }
    else if (width == 2) { LANES(int16_t, int64_t) }
    else if (width == 4) { LANES(int32_t, int64_t) }
    else { LANES(uint64_t, uint64_t) }
    sums[0] = s0;
    sums[1] = s1;
}
"""


def _declare(lib: ctypes.CDLL) -> None:
    lib.ldet_digest_lanes.restype = None
    lib.ldet_digest_lanes.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p]


KERNEL = LazyLibrary(SOURCE, "digest_lanes", _declare)


def whole_lanes(words: torch.Tensor, start: int = 0) -> tuple[int, int] | None:
    """The two lanes of a contiguous CPU integer view ``words`` (a tensor's bits), or ``None`` without the kernel.

    Word ``i`` lies at position ``start + i`` of the whole tensor. The kernel reads memory: it is handed only a plain,
    dense, contiguous CPU tensor of 1, 2, 4 or 8-byte words with storage of its own; anything else (a subclass, a
    sparse or meta tensor) takes the torch path, so no tensor can make it read outside its data.
    """
    if (
        type(words) is not torch.Tensor
        or words.layout != torch.strided
        or words.device.type != "cpu"
        or not words.is_contiguous()
        or words.element_size() not in (1, 2, 4, 8)
        or words.dtype.is_floating_point
        or words.dtype.is_complex
        or (words.numel() and not words.data_ptr())
        or not KERNEL.available()
    ):
        return None
    sums = (ctypes.c_uint64 * 2)()
    KERNEL.lib.ldet_digest_lanes(words.data_ptr(), words.numel(), words.element_size(), start, sums)
    return int(sums[0]), int(sums[1])


__all__ = ["KERNEL", "SOURCE", "whole_lanes"]
