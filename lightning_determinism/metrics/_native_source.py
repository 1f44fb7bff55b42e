"""The C source of the perplexity's CPU row kernel (:mod:`._native` builds and loads it).

What makes the bits the same on every path and CPU:

- the C source is generated from :mod:`._portable`'s constants (hexadecimal literals: no decimal rounding) and does
  its operations in its order, each rounded on its own: built with ``-ffp-contract=off`` (no fused multiply-add)
  and refused by a compiler whose ``float`` arithmetic is wider (x87);
- each exponential becomes an integer, and a row's integers are summed in lanes moved into a 128-bit total now and
  then: integer sums have no order, so vector width, lanes, threads (blocks of 8 rows claimed as they go) and the
  batch do not change a row's bits. With AVX-512DQ the compiler vectorises the loop (float to int64 in 16 lanes);
  elsewhere (AVX2, SSE2, NEON), where that conversion has no vector instruction, the block is written with vector
  types: each integer as ``hi * 2**26 + lo``, two exact float-to-int32 truncations summed in uint32 lanes;
- rows holding NaN, or whose max is infinite, get :data:`~._portable.NAN_MARK` (and a NaN max for NaN, as torch's
  ``amax`` gives).

While a row's exponentials are computed, the next row is prefetched into the L2 cache: the exponentials keep the
core busy, the prefetch uses the memory bandwidth that would otherwise wait for the next row's max.
"""

from __future__ import annotations

import string
import struct

from lightning_determinism.metrics import _portable

_C_TEMPLATE = r"""
#include <float.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#if FLT_EVAL_METHOD != 0
#error "float arithmetic in wider registers (x87): the bits would differ from the other paths"
#endif

#define LANES 16
#define FLUSH 1024 /* blocks of 16 summed per lane before the lanes go into the row's 128-bit total */
#define FLOOR ($FLOOR)

/* exp(d) * 2**52 rounded, for d in [FLOOR, 0]: _portable._exp_fixed, operation for operation (no FMA). */
static inline int64_t exp_fixed(float d) {
    float k = __builtin_rintf(d * $INV_LN2);
$EXP_BODY_FLOAT    int32_t bits;
    memcpy(&bits, &e, 4);
    bits += ((int32_t)k + $SCALE_BITS) << 23;
    memcpy(&e, &bits, 4);
    return (int64_t)(e + 0.5f); /* truncated after + 0.5, as torch's conversion: rounded, and it vectorises */
}

/* AVX-512DQ converts float to int64 in vector registers: there the loop below is left to the auto-vectoriser (one
   16-lane pass). Elsewhere (AVX2, SSE2, NEON) that conversion has no vector instruction and the loop ran scalar:
   there the block is written with vector types and 32-bit integers. The same bits either way (tested). */
#if !defined(__AVX512DQ__) && !defined(LDET_NO_VECTOR_BLOCK) && (defined(__clang__) || __GNUC__ >= 9)
#define VECTOR_BLOCK 1
#define BLOCK_FLUSH 32 /* blocks summed per lane before the lanes go into the total: 32 * 2**26 < 2**32 */
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));

/* exp_fixed's float before its truncation (e + 0.5), 8 lanes at once, operation for operation: rint as the add and
   subtraction of 1.5 * 2**23 (the same rounding for |x| < 2**22). */
static inline void exp_half8(v8f *inout) { /* by pointer: no 32-byte vector crosses a call's ABI */
    v8f d = *inout;
    const v8f magic = $SPLAT_MAGIC;
    v8f k = (d * $INV_LN2 + magic) - magic;
$EXP_BODY_V8F    v8i bits;
    memcpy(&bits, &e, 32);
    bits += (__builtin_convertvector(k, v8i) + $SCALE_BITS) << 23;
    memcpy(&e, &bits, 32);
    *inout = e + 0.5f;
}
#endif

static void one_row(const float *x, int64_t v, int64_t target, const float *next, int64_t next_bytes,
                    float *top, int64_t *sum_hi, int64_t *sum_lo, float *picked) {
    float m = x[0];
    int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
    for (int64_t j = 0; j < v; j++) {
        m = x[j] > m ? x[j] : m;
        nan |= x[j] != x[j];
    }
    *top = m;
    *picked = x[target];
    if (nan || m - m != 0.0f) { /* NaN, or an infinite max (+inf present, or every logit -inf) */
        if (nan) *top = __builtin_nanf(""); /* as torch's amax, which propagates NaN */
        *sum_hi = $NAN_MARK;
        *sum_lo = 0;
        return;
    }
    unsigned __int128 total = 0;
    const char *ahead = (const char *)next;
    const char *ahead_end = ahead + next_bytes;
    int64_t j0 = 0, blocks = 0;
#ifdef VECTOR_BLOCK
    /* Each integer exp as hi * 2**26 + lo (t < 2**52 + 1: hi, lo < 2**26, both exact int32 truncations), summed
       in uint32 lanes: only 32-bit integer conversions and adds, which every vector unit has. */
    const v8f floor8 = $SPLAT_FLOOR;
    v8u hi[2] = {{0}}, lo[2] = {{0}};
    for (; j0 + LANES <= v; j0 += LANES) {
        if (ahead < ahead_end) { /* one cache line of the next row per 16 logits of this one */
            __builtin_prefetch(ahead, 0, 2);
            ahead += 64;
        }
        for (int h = 0; h < 2; h++) {
            v8f d;
            memcpy(&d, x + j0 + 8 * h, 32);
            d = d - m;
            v8i above = d > floor8;
            d = (v8f)(((v8i)d & above) | ((v8i)floor8 & ~above)); /* max(d, FLOOR): d is no NaN here */
            v8f t = d;
            exp_half8(&t);
            v8i a = __builtin_convertvector(t * 0x1p-26f, v8i);
            v8i rest = __builtin_convertvector(t - __builtin_convertvector(a, v8f) * 0x1p26f, v8i);
            hi[h] += (v8u)a;
            lo[h] += (v8u)rest;
        }
        if (++blocks == BLOCK_FLUSH) {
            for (int h = 0; h < 2; h++) {
                for (int l = 0; l < 8; l++) total += ((uint64_t)hi[h][l] << 26) + lo[h][l];
                hi[h] = lo[h] = (v8u){0};
            }
            blocks = 0;
        }
    }
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < 8; l++) total += ((uint64_t)hi[h][l] << 26) + lo[h][l];
#else
    uint64_t lanes[LANES];
    for (int l = 0; l < LANES; l++) lanes[l] = 0;
    for (; j0 + LANES <= v; j0 += LANES) {
        if (ahead < ahead_end) {
            __builtin_prefetch(ahead, 0, 2);
            ahead += 64;
        }
#pragma omp simd
        for (int l = 0; l < LANES; l++) {
            float d = x[j0 + l] - m;
            lanes[l] += (uint64_t)exp_fixed(d > FLOOR ? d : FLOOR); /* one vmaxps */
        }
        if (++blocks == FLUSH) { /* each lane holds <= 1024 * 2**52: far from 2**64 */
            for (int l = 0; l < LANES; l++) {
                total += lanes[l];
                lanes[l] = 0;
            }
            blocks = 0;
        }
    }
    for (int l = 0; l < LANES; l++) total += lanes[l];
#endif
    for (; j0 < v; j0++) {
        float d = x[j0] - m;
        total += (uint64_t)exp_fixed(d > FLOOR ? d : FLOOR);
    }
    *sum_hi = (int64_t)(total >> 32);
    *sum_lo = (int64_t)(total & 0xffffffffu);
}

typedef struct {
    const float *logits;
    const int64_t *ids;
    int64_t n, v;
    int64_t *next_block; /* shared: the first row no thread has claimed yet */
    float *top;
    int64_t *sum_hi, *sum_lo;
    float *picked;
} job_t;

#define BLOCK 8 /* rows claimed at a time: a thread on a busy core takes fewer blocks */

static void *run(void *arg) {
    job_t *job = (job_t *)arg;
    int64_t begin = __atomic_fetch_add(job->next_block, BLOCK, __ATOMIC_RELAXED);
    while (begin < job->n) {
        int64_t end = begin + BLOCK < job->n ? begin + BLOCK : job->n;
        int64_t following = job->n;
        for (int64_t i = begin; i < end; i++) {
            const float *x = job->logits + i * job->v;
            const float *next = x + job->v;
            int64_t next_bytes = job->v * 4;
            if (i + 1 == end) { /* claim the next block now, to prefetch its first row during this one */
                following = __atomic_fetch_add(job->next_block, BLOCK, __ATOMIC_RELAXED);
                next = following < job->n ? job->logits + following * job->v : x;
                next_bytes = following < job->n ? next_bytes : 0;
            }
            one_row(x, job->v, job->ids[i], next, next_bytes, job->top + i, job->sum_hi + i, job->sum_lo + i,
                    job->picked + i);
        }
        begin = following;
    }
    return 0;
}

#ifdef __cplusplus
extern "C"
#endif
const char *ldet_row_sums_variant(void) {
#if defined(VECTOR_BLOCK) && defined(__AVX2__)
    return "vector block, AVX2";
#elif defined(VECTOR_BLOCK) && defined(__ARM_NEON)
    return "vector block, NEON";
#elif defined(VECTOR_BLOCK)
    return "vector block, 128-bit or none";
#elif defined(__AVX512DQ__)
    return "auto-vectorised, AVX-512";
#else
    return "auto-vectorised (older compiler)";
#endif
}

#ifdef __cplusplus
extern "C"
#endif
void ldet_row_sums(const float *logits, const int64_t *ids, int64_t n, int64_t v, int threads, float *top,
                   int64_t *sum_hi, int64_t *sum_lo, float *picked) {
    pthread_t tids[64];
    int started[64];
    int64_t next_block = 0;
    job_t job = {logits, ids, n, v, &next_block, top, sum_hi, sum_lo, picked};
    if (threads > 64) threads = 64;
    if (threads > (n + BLOCK - 1) / BLOCK) threads = (int)((n + BLOCK - 1) / BLOCK);
    if (threads < 1) threads = 1;
    for (int t = 1; t < threads; t++) started[t] = pthread_create(&tids[t], 0, run, &job) == 0;
    run(&job); /* rows are claimed, not assigned: a thread that could not start leaves its rows to the others */
    for (int t = 1; t < threads; t++)
        if (started[t]) pthread_join(tids[t], 0);
}
"""


def _c_float(value: float) -> str:
    """A float32 constant as an exact C literal (hexadecimal: no decimal rounding on the way)."""
    if struct.unpack("f", struct.pack("f", value))[0] != value:
        raise ValueError(f"{value!r} is not a float32 value")
    return f"{value.hex()}f"


def _source() -> str:
    def splat(value: float) -> str:
        return "{" + ", ".join([_c_float(value)] * 8) + "}"

    def exp_body(kind: str, p0: str) -> str:
        """``exp(r)``'s steps after ``k``, in one order for the scalar and the vector code (their bits must agree)."""
        lines = [
            f"{kind} r_hi = d - k * {_c_float(_portable.LN2_HI)};",
            f"{kind} s = k * {_c_float(_portable.LN2_LO)};",
            f"{kind} rh = r_hi - s;",
            f"{kind} rl = (r_hi - rh) - s;",
            f"{kind} p = {p0};",
            *(f"p = p * rh + {_c_float(c)};" for c in _portable.POLY[1:]),
            f"{kind} q = p * (rh * rh) + rl;",
            f"{kind} e = (rh + q) + 1.0f;",
        ]
        return "".join(f"    {line}\n" for line in lines)

    values = {
        "SPLAT_MAGIC": splat(1.5 * 2.0**23),
        "SPLAT_FLOOR": splat(_portable.FLOOR),
        "FLOOR": _c_float(_portable.FLOOR),
        "INV_LN2": _c_float(_portable.INV_LN2_F),
        "EXP_BODY_FLOAT": exp_body("float", _c_float(_portable.POLY[0])),
        "EXP_BODY_V8F": exp_body("v8f", splat(_portable.POLY[0])),
        "SCALE_BITS": str(_portable.SCALE_BITS),
        "NAN_MARK": str(_portable.NAN_MARK),
    }
    return string.Template(_C_TEMPLATE).substitute(values)


SOURCE = _source()


__all__ = ["SOURCE"]
