"""Helpers for multi-process tests: fast forked gloo ranks whose real failure is the one reported."""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 30.0
# A child Python process (an example, a resume phase, a torchrun node): ~25 s at most here; CI machines can be slower.
CHILD_TIMEOUT_S = 600


def requires_cuda(test: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a test ``gpu`` (``pytest -m gpu`` runs every CUDA test: scripts/gpu_check.sh) and skip it without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test))


def requires_feature(feature: str) -> pytest.MarkDecorator:
    """Skip where the installed torch lacks what ``feature`` needs (``_compat.checks.NEWER_TORCH``), with the reason."""
    from lightning_determinism._compat.checks import available
    from lightning_determinism._compat.features import FEATURES

    return pytest.mark.skipif(
        not available(feature), reason=f"{feature} needs {FEATURES[feature]}; torch {torch.__version__} here"
    )


def require_compiled_kernel() -> None:
    """Skip where the perplexity kernel cannot compile (no C++ compiler); a failed compile anywhere else fails.

    A dependency that breaks ``torch.compile`` (typing_extensions 4.10 under torch 2.13) must turn the suite red, not
    quietly skip the compiled path's tests.
    """
    from lightning_determinism.metrics._native import find_compiler
    from lightning_determinism.metrics._nll import KERNEL, _have_cxx

    if KERNEL.native.failed is not None and find_compiler() is not None:
        pytest.fail(f"the perplexity's C kernel did not build, though a C compiler is present: {KERNEL.native.failed}")
    if KERNEL.available():
        return
    if not _have_cxx():
        pytest.skip(f"torch.compile is not usable here: {KERNEL.failed}")
    pytest.fail(f"the perplexity kernel did not compile, though a C++ compiler is present: {KERNEL.failed}")


def _rank_entry(
    rank: int, fn: Callable[..., Any], world_size: int, workdir: str, start_method: str, args: tuple[Any, ...]
) -> None:
    err_file = Path(workdir) / f"error-rank{rank}.txt"
    try:
        torch.set_num_threads(1)  # two ranks on two cores: no oversubscription
        dist.init_process_group(
            "gloo",
            init_method=f"file://{workdir}/store",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=TIMEOUT_S),
        )
        fn(rank, world_size, *args)
    except BaseException:
        err_file.write_text(f"{time.time_ns()}\n{traceback.format_exc()}")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any], tmp_path: Path, *args: Any, world_size: int = 2, start_method: str = "fork"
) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; re-raise the earliest rank failure."""
    workdir = tmp_path / f"dist-{time.time_ns()}"
    workdir.mkdir()
    ctx = mp.start_processes(
        _rank_entry,
        args=(fn, world_size, str(workdir), start_method, args),
        nprocs=world_size,
        join=False,
        start_method=start_method,
    )
    deadline = time.monotonic() + TIMEOUT_S + 30
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in ctx.processes:
                    process.kill()
                raise TimeoutError(f"{world_size} ranks did not finish within {TIMEOUT_S + 30:.0f} s")
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
        reports = sorted(
            (int(text.split("\n", 1)[0]), path.name, text.split("\n", 1)[1])
            for path in workdir.glob("error-rank*.txt")
            for text in [path.read_text()]
        )
        if reports:
            _, name, trace = reports[0]
            raise AssertionError(f"earliest failure ({name}):\n{trace}") from err
        raise


_HANDED_OUT: set[int] = set()  # every port given out in this session: jobs started early rebind theirs between fits


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago and that this session has not handed out before."""
    import socket

    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def child_env(**extra: str) -> dict[str, str]:
    """``os.environ`` for a child process, with a port of its own for Lightning's rendezvous and ``extra`` on top."""
    return {**os.environ, "MASTER_PORT": str(free_port()), **extra}


def env_without(*keys: str) -> dict[str, str]:
    """A copy of ``os.environ`` without ``keys``."""
    return {key: value for key, value in os.environ.items() if key not in keys}
