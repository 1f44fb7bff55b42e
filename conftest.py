"""Fixtures shared by the tests and the package's doctests: every test leaves the process as it found it."""

import gc
import os
import random

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.helpers import free_port

_ENV_KEYS = (
    "PL_GLOBAL_SEED",
    "PL_SEED_WORKERS",
    "CUBLAS_WORKSPACE_CONFIG",
    "LDET_BASE_SEED",
    "LDET_LOCAL_SEED",
    "MASTER_PORT",
)


def _capture() -> tuple:
    env = {key: os.environ.get(key) for key in _ENV_KEYS}
    flags = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
    )
    rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return env, flags, rng, cuda_rng, torch.get_num_threads()


def _restore(state: tuple) -> None:
    env, flags, rng, cuda_rng, threads = state
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
    torch.backends.cudnn.deterministic = flags[2]
    torch.backends.cudnn.benchmark = flags[3]
    torch.backends.cuda.matmul.allow_tf32 = flags[4]
    torch.backends.cudnn.allow_tf32 = flags[5]
    random.setstate(rng[0])
    np.random.set_state(rng[1])
    torch.set_rng_state(rng[2])
    if cuda_rng is not None:
        torch.cuda.set_rng_state_all(cuda_rng)
    torch.set_num_threads(threads)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True, scope="module")
def _restore_global_state_per_module():
    """What a module-scoped fixture changes (a fit run once for a module's tests) does not reach the next module."""
    state = _capture()
    yield
    _restore(state)


@pytest.fixture(autouse=True)
def _restore_global_state():
    state = _capture()
    # Lightning's launcher writes the port it picked into os.environ, where every later fit (and every child
    # process) would reuse it for the rest of the session; one process still holding it then fails them all.
    os.environ["MASTER_PORT"] = str(free_port())
    yield
    _restore(state)


def pytest_sessionstart(session):
    """Start the warm interpreter (tests/helpers/warm.py) before collection.

    Its imports take a core for ~5 s, which collection (one core) leaves idle. Not when the run leaves out the tests
    that start processes.
    """
    option = session.config.option
    if not option.collectonly and "not distributed" not in (option.markexpr or ""):
        from tests.helpers import warm

        warm.prestart()


def pytest_collection_finish(session):
    """Freeze what the imports and the collection made out of the garbage collector.

    The suite forks ranks and workers from this process hundreds of times, and a collection in a child would walk (and
    so copy) all of it.
    """
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def spawn_fit(tmp_path_factory):
    """The suite's one fit on spawned ranks (4 new interpreters, ~5 s of CPU each).

    2 ranks, each reading a second loader through 1 spawned worker. Its records: tests/strategies/test_strategy_fit.py;
    its worker streams: tests/callbacks/test_worker_seed_dist.py.
    """
    from lightning_determinism import DeterministicDDPStrategy, WorkerSeedCallback
    from tests.helpers.lightning_models import fit

    out = tmp_path_factory.mktemp("spawn")
    torch.manual_seed(3)  # the parent's state, which the ranks must not inherit
    # The module holds DistributedPerplexity and DistributedMean: the spawn launcher pickles it for each rank.
    fit(DeterministicDDPStrategy(seed=5, start_method="spawn"), out, n=16, metrics=True, stream_workers=1,
        callbacks=[WorkerSeedCallback()])  # fmt: skip
    return out
