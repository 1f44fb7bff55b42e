"""The perplexity's CPU row kernel in C: one function, compiled once per machine with the C compiler on the ``PATH``.

Per row of float32 logits (from 4,096 classes) it returns the row max, the row's sum of ``exp(x - max)`` as an exact
integer number of ``2**-52`` (two int64 pieces), and the target's logit -- bit for bit what
:func:`~lightning_determinism.metrics._portable.row_sums` computes with torch (eager or compiled by Inductor), at
about 1.4x the speed of Inductor's kernel on a 2-core AVX-512 machine. Where the time goes: ``docs/perplexity.md``.
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

The shared library is cached under :data:`CACHE_ENV` (default: ``<tempdir>/lightning_determinism-<user>``), keyed
by the source, the compiler and its flags, and the CPU; nothing found there is loaded unless this user alone can have
written it (:mod:`~lightning_determinism.metrics._kernel_cache`). No OpenMP: threads are started per call (pthreads) and
joined before it returns, so a forked process inherits no thread pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import string
import struct
import subprocess
import threading
from typing import Any

import torch
from torch import Tensor

from lightning_determinism.metrics import _portable
from lightning_determinism.metrics._kernel_cache import CACHE_ENV, cache_dir, load_trusted, untrusted

_HALF_CHUNK_BYTES = 2 * 2**20  # float16/bfloat16 logits are upcast (exactly) one chunk of rows at a time

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


def find_compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang", "c++", "g++", "clang++"):  # C++ compilers take it too
        if name and shutil.which(name):
            return name
    return None


def _cpu_identity() -> str:
    """What ``-march=native`` depends on: the model and feature flags (Linux), or what Python knows of the CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f.read(1 << 16).splitlines() if line.startswith(("model name", "flags"))]
        return "\n".join(lines[:2])
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


MARCH_ENV = "LDET_KERNEL_MARCH"
"""Build the C kernel for this ``-march`` instead of ``native`` (e.g. ``haswell``: the AVX2 kernel, measured on an
AVX-512 machine); ``benchmarks/perplexity.py`` prints which."""


def _flag_sets() -> list[list[str]]:
    base = ["-O3", "-std=c99", "-fopenmp-simd", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC", "-pthread"]
    march = os.environ.get(MARCH_ENV)
    native = [f"-march={march or 'native'}"]
    if platform.machine().lower() in ("x86_64", "amd64") and not march:
        native.append("-mprefer-vector-width=512")  # AVX-512 where there is some; ignored elsewhere
    return [base + native, base]  # without -march=native where the compiler refuses it (some ARM toolchains)


def library_path(compiler: str, version: str, flags: list[str], source: str = SOURCE, stem: str = "row_sums") -> str:
    """Where the library built from ``source`` by ``compiler`` (its ``--version``) with ``flags`` is cached."""
    key = hashlib.sha256("\0".join([source, compiler, version, *flags, _cpu_identity()]).encode()).hexdigest()
    return os.path.join(cache_dir(), f"{stem}_{key[:24]}.so")


def _compile(compiler: str, flags: list[str], target: str, code: str = SOURCE) -> str | None:
    """Build the library into ``target``; the compiler's message on failure."""
    os.makedirs(os.path.dirname(target), mode=0o700, exist_ok=True)
    source = f"{target[:-3]}_{os.getpid()}_{threading.get_ident()}.c"
    partial = f"{source}.so"
    with open(source, "w") as f:
        f.write(code)
    try:
        done = subprocess.run([compiler, *flags, "-x", "c", source, "-o", partial], capture_output=True, text=True)
    finally:
        os.remove(source)
    if done.returncode != 0:
        return " ".join(done.stderr.split())[:300]
    os.replace(partial, target)  # atomic: processes building at once each install a whole library
    return None


def _declare_row_sums(lib: ctypes.CDLL) -> None:
    lib.ldet_row_sums_variant.restype = ctypes.c_char_p
    lib.ldet_row_sums_variant.argtypes = []
    lib.ldet_row_sums.restype = None
    lib.ldet_row_sums.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                                  ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]  # fmt: skip


def build(source: str = SOURCE, stem: str = "row_sums", declare: Any = _declare_row_sums) -> ctypes.CDLL:
    """Compile (or find in the cache) and load a kernel: the perplexity's by default.

    Another kernel passes its ``source``, a file ``stem`` and ``declare``, which sets its functions' argument types.
    A cached file that does not load (truncated, another architecture's) is built again.

    Raises:
        RuntimeError: no C compiler on the ``PATH``, or it failed (its message included).
    """
    compiler = find_compiler()
    if compiler is None:
        raise RuntimeError("no C compiler on the PATH (looked for $CC, cc, gcc, clang)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    errors = []
    for flags in _flag_sets():
        target = library_path(compiler, version, flags, source, stem)
        if os.path.lexists(target) and untrusted(target, directory=False) is not None:
            os.remove(target)  # the directory is ours: a file in it that is not stays unloaded, and is built again
        if not os.path.exists(target):
            error = _compile(compiler, flags, target, source)
            if error is not None:
                errors.append(error)
                continue
        try:
            lib = load_trusted(target)
        except OSError:
            error = _compile(compiler, flags, target, source)
            if error is not None:
                errors.append(error)
                continue
            lib = load_trusted(target)
        declare(lib)
        return lib
    raise RuntimeError(f"{compiler} failed: {errors[-1] if errors else 'unknown error'}")


class LazyLibrary:
    """A kernel's library (see :func:`build`), built on first use.

    Once building has failed in this process, :meth:`available` is ``False`` for good and :attr:`failed` says why.
    """

    def __init__(self, source: str, stem: str, declare: Any) -> None:
        self.source, self.stem, self.declare = source, stem, declare
        self.lib: Any = None
        self.failed: str | None = None
        self._lock = threading.Lock()

    def available(self) -> bool:
        """Whether the library is loaded (building it now if no attempt was made yet)."""
        if self.lib is None and self.failed is None:
            with self._lock:  # threads of one process build once
                if self.lib is None and self.failed is None:
                    try:
                        self.lib = build(self.source, self.stem, self.declare)
                    except Exception as err:  # noqa: BLE001  (any toolchain failure: the caller falls back)
                        self.failed = f"{type(err).__name__}: {err}"
        return self.lib is not None


class NativeKernel(LazyLibrary):
    """:data:`SOURCE` built on first use; ``None`` from every call once building has failed in this process."""

    def __init__(self) -> None:
        super().__init__(SOURCE, "row_sums", _declare_row_sums)
        self._variant: str | None = None

    def variant(self) -> str | None:
        """How the built kernel's loop is vectorised: ``"vector block, AVX2"``, ``"auto-vectorised, AVX-512"``, ...

        ``None`` where it cannot be built.
        """
        if self._variant is None and self.available():  # read once: every update names it
            self._variant = str(self.lib.ldet_row_sums_variant().decode())  # type: ignore[union-attr]
        return self._variant

    def __call__(self, logits: Tensor, ids: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
        """Row max, the row sum's two int64 pieces (:func:`._portable.row_sums`) and the target's logit.

        ``logits`` is a CPU ``[N, V]`` tensor of float32, float16 or bfloat16 (half types are upcast exactly).
        """
        if not self.available():
            return None
        n, vocab = logits.shape
        if vocab < 1:
            raise ValueError(f"`logits` must have at least one class, got shape {tuple(logits.shape)}")
        ids = ids.to(torch.int64).contiguous()
        if n and (int(ids.min()) < 0 or int(ids.max()) >= vocab):  # C reads what it is told to: check first
            raise ValueError(f"`ids` must lie in [0, {vocab}), got values in [{int(ids.min())}, {int(ids.max())}]")
        top = torch.empty(n, dtype=torch.float32)
        sum_hi = torch.empty(n, dtype=torch.int64)
        sum_lo = torch.empty(n, dtype=torch.int64)
        picked = torch.empty(n, dtype=torch.float32)
        outs = (top, sum_hi, sum_lo, picked)
        threads = torch.get_num_threads()
        if logits.dtype == torch.float32:
            self._rows(logits.contiguous(), ids, 0, n, vocab, threads, outs)
        else:  # float16 / bfloat16: upcast exactly, a chunk of rows at a time
            rows = max(1, _HALF_CHUNK_BYTES // (4 * vocab))
            buffer = torch.empty((min(rows, n), vocab), dtype=torch.float32)
            for start in range(0, n, rows):
                chunk = logits[start : start + rows]
                view = buffer[: chunk.shape[0]]
                view.copy_(chunk)
                self._rows(view, ids[start:], start, chunk.shape[0], vocab, threads, outs)
        return outs

    def _rows(self, x: Tensor, ids: Tensor, start: int, n: int, vocab: int, threads: int, outs: tuple) -> None:
        pointers = [out[start:].data_ptr() for out in outs]
        self.lib.ldet_row_sums(x.data_ptr(), ids.data_ptr(), n, vocab, threads, *pointers)


__all__ = [
    "CACHE_ENV",
    "LazyLibrary",
    "NativeKernel",
    "SOURCE",
    "build",
    "cache_dir",
    "find_compiler",
    "library_path",
    "untrusted",
]
