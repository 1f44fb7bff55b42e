"""The perplexity's CPU row kernel in C: one function, compiled once per machine with the C compiler on the ``PATH``.

Per row of float32 logits (from 4,096 classes) it returns the row max, the row's sum of ``exp(x - max)`` as an exact
integer number of ``2**-52`` (two int64 pieces), and the target's logit -- bit for bit what
:func:`~lightning_determinism.metrics._portable.row_sums` computes with torch (eager or compiled by Inductor), at
about 1.4x the speed of Inductor's kernel on a 2-core AVX-512 machine. Where the time goes: ``docs/perplexity.md``.
The C source (:mod:`._native_source`) says what makes the bits the same on every path and CPU.

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
from lightning_determinism.metrics._native_source import SOURCE

_HALF_CHUNK_BYTES = 2 * 2**20  # float16/bfloat16 logits are upcast (exactly) one chunk of rows at a time


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
