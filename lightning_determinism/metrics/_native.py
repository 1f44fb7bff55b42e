"""The perplexity's CPU row kernel in C: one function, compiled once per machine with the C compiler on the ``PATH``.

Per row of float32 logits it returns the row max, ``sum(exp(x - max))`` accumulated in float64, and the target's
logit -- what Inductor's kernel returns, at about twice its speed on a 2-core AVX-512 machine. Where the time goes
and why this is faster: ``docs/perplexity.md``. What makes it exact enough:

- ``exp`` is written here: ``2**k * exp(r)`` with ``r = d - k ln2`` reduced in two steps, the second step's
  rounding error carried on (``r = rh + rl``), and a degree-8 polynomial whose coefficients were fitted for this
  range (largest relative error 2.3e-10 before float32 rounding). A rounded ``r`` alone biased every exponential
  with the same ``k`` in the same direction (logits sit on a float32 grid), by up to 3e-9.
- Each row is summed by one thread in a fixed order: 16 float64 lanes, element ``j`` into lane ``j % 16``, then the
  tail, then the lanes in order. Threads claim blocks of 8 rows as they go (a thread on a busy core takes fewer),
  never part of a row: the bits of a row do not depend on the batch, the thread count or which thread took it.
  Another compiler or CPU (vector width, ``-march=native``) may round differently.
- Rows holding NaN, or whose max is infinite, get a NaN sum (as Inductor's kernel gives).

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
import subprocess
import threading
from typing import Any

import torch
from torch import Tensor

from lightning_determinism.metrics._kernel_cache import CACHE_ENV, cache_dir, load_trusted, untrusted

_HALF_CHUNK_BYTES = 2 * 2**20  # float16/bfloat16 logits are upcast (exactly) one chunk of rows at a time

SOURCE = r"""
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define LANES 16
#define FLOOR (-87.0f) /* exp() below it is subnormal: slow, and < 2e-38 of a row's sum */

/* exp(d) for d in [FLOOR, 0]: 2**k * exp(rh + rl). */
static inline float exp_le0(float d) {
    float k = __builtin_rintf(d * 1.44269504088896341f);
    float r1 = __builtin_fmaf(-k, 0.693359375f, d);          /* exact: ln2's first 9 bits times k <= 126 */
    float rh = __builtin_fmaf(-k, -2.12194440e-4f, r1);      /* the rest of ln2, rounded ... */
    float rl = __builtin_fmaf(-k, -2.12194440e-4f, r1 - rh); /* ... and what that rounding dropped */
    float p = 2.470828258083202e-05f;
    p = __builtin_fmaf(p, rh, 0.00019908939430024475f);
    p = __builtin_fmaf(p, rh, 0.001388919772580266f);
    p = __builtin_fmaf(p, rh, 0.008333281613886356f);
    p = __builtin_fmaf(p, rh, 0.0416666641831398f);
    p = __builtin_fmaf(p, rh, 0.1666666716337204f);
    p = __builtin_fmaf(p, rh, 0.5f);
    float q = __builtin_fmaf(p, rh * rh, rl);
    float e = (rh + q) + 1.0f; /* in [0.70, 1.42]; times 2**k stays normal for d >= FLOOR */
    int32_t bits;
    memcpy(&bits, &e, 4);
    bits += (int32_t)k << 23;
    memcpy(&e, &bits, 4);
    return e;
}

static void one_row(const float *x, int64_t v, int64_t target, const float *next, int64_t next_bytes,
                    float *top, double *sum, float *picked) {
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
        *sum = __builtin_nan("");
        return;
    }
    double lanes[LANES];
    for (int l = 0; l < LANES; l++) lanes[l] = 0.0;
    const char *ahead = (const char *)next;
    const char *ahead_end = ahead + next_bytes;
    int64_t j0 = 0;
    for (; j0 + LANES <= v; j0 += LANES) {
        if (ahead < ahead_end) { /* one cache line of the next row per 16 logits of this one */
            __builtin_prefetch(ahead, 0, 2);
            ahead += 64;
        }
#pragma omp simd
        for (int l = 0; l < LANES; l++) {
            float d = x[j0 + l] - m;
            lanes[l] += (double)exp_le0(d < FLOOR ? FLOOR : d);
        }
    }
    double total = 0.0;
    for (; j0 < v; j0++) {
        float d = x[j0] - m;
        total += (double)exp_le0(d < FLOOR ? FLOOR : d);
    }
    for (int l = 0; l < LANES; l++) total += lanes[l];
    *sum = total;
}

typedef struct {
    const float *logits;
    const int64_t *ids;
    int64_t n, v;
    int64_t *next_block; /* shared: the first row no thread has claimed yet */
    float *top;
    double *sums;
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
            one_row(x, job->v, job->ids[i], next, next_bytes, job->top + i, job->sums + i, job->picked + i);
        }
        begin = following;
    }
    return 0;
}

#ifdef __cplusplus
extern "C"
#endif
void ldet_row_stats(const float *logits, const int64_t *ids, int64_t n, int64_t v, int threads, float *top,
                    double *sums, float *picked) {
    pthread_t tids[64];
    int started[64];
    int64_t next_block = 0;
    job_t job = {logits, ids, n, v, &next_block, top, sums, picked};
    if (threads > 64) threads = 64;
    if (threads > (n + BLOCK - 1) / BLOCK) threads = (int)((n + BLOCK - 1) / BLOCK);
    if (threads < 1) threads = 1;
    for (int t = 1; t < threads; t++) started[t] = pthread_create(&tids[t], 0, run, &job) == 0;
    run(&job); /* rows are claimed, not assigned: a thread that could not start leaves its rows to the others */
    for (int t = 1; t < threads; t++)
        if (started[t]) pthread_join(tids[t], 0);
}
"""


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


def _flag_sets() -> list[list[str]]:
    base = ["-O3", "-std=c99", "-fopenmp-simd", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC", "-pthread"]
    native = ["-march=native"]
    if platform.machine().lower() in ("x86_64", "amd64"):
        native.append("-mprefer-vector-width=512")  # AVX-512 where there is some; ignored elsewhere
    return [base + native, base]  # without -march=native where the compiler refuses it (some ARM toolchains)


def library_path(compiler: str, version: str, flags: list[str], source: str = SOURCE, stem: str = "row_stats") -> str:
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


def _declare_row_stats(lib: ctypes.CDLL) -> None:
    lib.ldet_row_stats.restype = None
    lib.ldet_row_stats.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]  # fmt: skip


def build(source: str = SOURCE, stem: str = "row_stats", declare: Any = _declare_row_stats) -> ctypes.CDLL:
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
        super().__init__(SOURCE, "row_stats", _declare_row_stats)

    def __call__(self, logits: Tensor, ids: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
        """Row max, float64 sum of ``exp(x - max)`` and target logit of CPU ``logits`` ``[N, V]`` (not float64)."""
        if not self.available():
            return None
        n, vocab = logits.shape
        if vocab < 1:
            raise ValueError(f"`logits` must have at least one class, got shape {tuple(logits.shape)}")
        ids = ids.to(torch.int64).contiguous()
        if n and (int(ids.min()) < 0 or int(ids.max()) >= vocab):  # C reads what it is told to: check first
            raise ValueError(f"`ids` must lie in [0, {vocab}), got values in [{int(ids.min())}, {int(ids.max())}]")
        top = torch.empty(n, dtype=torch.float32)
        sums = torch.empty(n, dtype=torch.float64)
        picked = torch.empty(n, dtype=torch.float32)
        threads = torch.get_num_threads()
        if logits.dtype == torch.float32:
            x = logits.contiguous()
            self._rows(x, ids, 0, n, vocab, threads, top, sums, picked)
        else:  # float16 / bfloat16: upcast exactly, a chunk of rows at a time
            rows = max(1, _HALF_CHUNK_BYTES // (4 * vocab))
            buffer = torch.empty((min(rows, n), vocab), dtype=torch.float32)
            for start in range(0, n, rows):
                chunk = logits[start : start + rows]
                view = buffer[: chunk.shape[0]]
                view.copy_(chunk)
                self._rows(view, ids[start:], start, chunk.shape[0], vocab, threads, top, sums, picked)
        return top, sums, picked

    def _rows(self, x: Tensor, ids: Tensor, start: int, n: int, vocab: int, threads: int, *outs: Tensor) -> None:
        top, sums, picked = (out[start:] for out in outs)
        self.lib.ldet_row_stats(
            x.data_ptr(), ids.data_ptr(), n, vocab, threads, top.data_ptr(), sums.data_ptr(), picked.data_ptr()
        )


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
