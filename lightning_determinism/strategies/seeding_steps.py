"""The seeding contract's steps, shared by the Trainer strategies and the Fabric strategies.

Both families act at the same two moments of their life cycle, with the same effects:

1. :meth:`SeedingSteps.ranks_known` — ranks and the process group exist (the end of ``setup_environment``): agree on
   the base seed (given, ``PL_GLOBAL_SEED``, or drawn on rank 0 and broadcast), export it as ``PL_GLOBAL_SEED``, set
   the backend flags and seed every rank with the *base* seed, so models built next are identical on every rank
   and identical to a one-process run;
2. :meth:`SeedingSteps.model_built` — the model exists: seed every rank with ``base + rank`` (or the topology's
   streams), so training-time draws differ between ranks, reproducibly.

:class:`SeedingSteps` also remembers the environment variables it sets, and puts them back with
:meth:`SeedingSteps.restore_env` at teardown.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_prefixed_message, rank_zero_info

from lightning_determinism.parallel import dtensor_random
from lightning_determinism.parallel.topology import Topology, model_parallel_seed, stream_seeds
from lightning_determinism.seeding.backends import (
    configure_determinism,
    debug_mode_name,
    normalize_debug_mode,
    set_cublas_workspace,
)
from lightning_determinism.seeding.record import BASE_SEED_ENV, LOCAL_SEED_ENV
from lightning_determinism.seeding.seeds import _record_seeds, broadcast_seed, check_seed, resolve_base_seed, seed_all

log = logging.getLogger("lightning_determinism.strategies")

CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"
SEED_ENV = ("PL_GLOBAL_SEED", BASE_SEED_ENV, LOCAL_SEED_ENV)


def _world_of(degrees: dict[str, Any]) -> int:
    """The world size a dict of degrees implies, with ``dp_degree`` missing taken as 1 (validation only)."""
    world = 1
    for key in ("dp_degree", "pp_degree", "sharding_degree", "sep_degree", "mp_degree"):
        value = degrees.get(key, 1)
        world *= value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1
    return world


class _DefaultDebugMode(str):
    """``"error"`` as the strategies' default: told apart from an ``"error"`` the user gave (the Trainer's flags)."""

    __slots__ = ()


DEFAULT_DEBUG_MODE = _DefaultDebugMode("error")


def plain_topology(topology: Any) -> Any:
    """A ``topology`` given as any mapping (Hydra's ``DictConfig``, a ``MappingProxyType``) as a plain dict.

    Its sequences (``order``, Hydra's ``ListConfig``) become tuples: the dict pickles to spawned ranks and compares
    equal to the mesh's own. Anything else is returned as it is.

    Examples:
        >>> from types import MappingProxyType
        >>> plain_topology(MappingProxyType({"mp_degree": 2, "order": ["dp", "pp", "sharding", "sep", "mp"]}))
        {'mp_degree': 2, 'order': ('dp', 'pp', 'sharding', 'sep', 'mp')}
    """
    if isinstance(topology, Topology) or not isinstance(topology, Mapping):
        return topology
    return {
        key: tuple(value) if isinstance(value, Sequence) and not isinstance(value, str) else value
        for key, value in topology.items()
    }


class SeedingSteps:
    """One strategy's seeding: its arguments, checked now, and the two steps of the contract.

    Args:
        seed: base seed, or ``None`` (``PL_GLOBAL_SEED`` when set, else drawn on rank 0 and broadcast).
        debug_mode: backend flags, as in :func:`~lightning_determinism.configure_determinism`.
        topology: model-parallel degrees (a dict) or a :class:`~lightning_determinism.parallel.topology.Topology`.

    Raises:
        TypeError, ValueError: for a bad seed, debug mode or topology, naming the argument.

    Examples:
        >>> steps = SeedingSteps(seed=7, debug_mode="warn")
        >>> steps.seed, steps.debug_mode, steps.base_seed
        (7, 1, None)
    """

    def __init__(self, seed: int | None = None, debug_mode: Any = DEFAULT_DEBUG_MODE, topology: Any = None) -> None:
        self.seed = None if seed is None else check_seed(seed)
        self.debug_mode = normalize_debug_mode(debug_mode)
        # The mode as constructed (the Trainer's `deterministic` may decide it where it was not given: see
        # strategies.arguments.follow_trainer_flags) and the Trainer's `benchmark` (kept under debug_mode="default").
        self.asked_debug_mode, self.debug_mode_given = self.debug_mode, debug_mode is not DEFAULT_DEBUG_MODE
        self.benchmark: bool | None = None
        topology = plain_topology(topology)
        if topology is not None and not isinstance(topology, (Topology, dict)):
            raise TypeError(
                f"`topology` must be a Topology, a mapping of degrees or None, got {type(topology).__name__}"
            )
        if isinstance(topology, dict):
            Topology(0, _world_of(topology), **topology)  # validate the degrees now, not after launching
        self.topology_spec = topology
        self.topology: Topology | None = topology if isinstance(topology, Topology) else None
        self.distinct_data_parallel = False  # the tracker's stream: set by the model-parallel strategies (mesh rule)
        self.dtensor_random_routed = False  # DTensor random ops drawn whole (mesh rule), undone by restore_env()
        self.base_seed: int | None = None
        self.local_seed: int | None = None
        self.seed_source: str | None = None  # "given", "seed_everything" or "drawn" (on rank 0, then broadcast)
        self._source = ""
        # What this process's environment held before the strategy touched it; restore_env() puts it back.
        self.saved_env: dict[str, str | None] = {}
        self.prepare_launch()

    def prepare_launch(self) -> None:
        """Where CUDA is, set ``CUBLAS_WORKSPACE_CONFIG`` now: at construction, and again before each launch.

        cuBLAS reads it when its first handle is created; Lightning initialises CUDA before ``setup_environment``,
        so it is set before the ranks start (they inherit it) rather than warned about there. Without CUDA nothing
        reads it: the user's process is left as it is until a rank sets its flags. The launchers restore it in the
        launching process when the ranks are done (:meth:`restore_env`), the ranks at their teardown.
        """
        self.saved_env.setdefault(CUBLAS_ENV, os.environ.get(CUBLAS_ENV))
        if self.debug_mode in (1, 2) and torch.cuda.is_available():
            set_cublas_workspace()

    @property
    def debug_mode_name(self) -> str:
        """The debug mode as a name (``"error"``, ``"warn"``, ``"default"``, ``"none"``)."""
        return debug_mode_name(self.debug_mode)

    def ranks_known(self, rank: int, world_size: int, before_log: Any = None, announce: bool = True) -> int:
        """Step 1: agree on the base seed, set the flags, seed every rank with the base seed; returns it.

        ``before_log`` (a callable) runs after seeding and before the seed lines are printed; with
        ``announce=False`` they are printed by a later :meth:`announce`.
        """
        for key in (*SEED_ENV, CUBLAS_ENV):
            self.saved_env.setdefault(key, os.environ.get(key))
        if self.seed is not None:
            source, self.seed_source = "given to the strategy", "given"
        elif os.environ.get("PL_GLOBAL_SEED") is not None:
            source, self.seed_source = "taken from PL_GLOBAL_SEED (seed_everything)", "seed_everything"
        else:
            source, self.seed_source = "drawn on rank 0: pass seed=<it> to the strategy to repeat this run", "drawn"
        base = resolve_base_seed(self.seed, rank, world_size, use_pl_global_seed=True)
        spec = self.topology_spec
        if isinstance(spec, dict):
            self.topology = Topology(rank, world_size, **spec)
        elif isinstance(spec, Topology) and (spec.rank, spec.world_size) != (rank, world_size):
            raise ValueError(
                f"[rank: {rank}] `topology` was built for rank {spec.rank} of {spec.world_size}, but this process is"
                f" rank {rank} of {world_size}; pass the degrees as a dict to build it on every rank"
            )
        configure_determinism(self.debug_mode)  # type: ignore[arg-type]
        if self.debug_mode == 0 and self.benchmark is not None:
            torch.backends.cudnn.benchmark = self.benchmark  # the Trainer's explicit `benchmark` under "default"
        self._adopt(base, rank)
        self._source = source
        if before_log is not None:
            before_log()
        if announce:
            self.announce(rank)
        return base

    def adopt_later_seed(self, rank: int, world_size: int) -> bool:
        """Take a ``seed_everything(s)`` called after the ranks were known (Fabric: after ``launch()``) as the base.

        Collective when ``PL_GLOBAL_SEED`` changed on any rank; rank 0's value is broadcast. Returns whether the
        base seed changed.
        """
        env = os.environ.get("PL_GLOBAL_SEED")
        if self.seed is not None or self.base_seed is None or env is None or int(env) == self.base_seed:
            return False
        base = broadcast_seed(check_seed(int(env), world_size, name="PL_GLOBAL_SEED")) if world_size > 1 else int(env)
        self._adopt(base, rank, reseed=False)
        self._source = "taken from seed_everything, called after the processes were launched"
        self.seed_source = "seed_everything"
        return True

    def adopt_resumed_seed(self, base: int, rank: int) -> bool:
        """A resume of a checkpoint written under ``base``: taken as the base seed where this run drew its own.

        A drawn seed is arbitrary (none was given, no ``seed_everything``): the checkpoint's continues the run it holds
        (the epoch's order, the per-sample, worker and micro-batch seeds). A given seed is kept. Every rank reads the
        same checkpoint, so no collective. Returns whether the base seed changed.

        Examples:
            >>> steps = SeedingSteps()
            >>> steps.saved_env.update({key: os.environ.get(key) for key in SEED_ENV})  # put back by restore_env()
            >>> steps.base_seed, steps.seed_source = 123, "drawn"
            >>> steps.adopt_resumed_seed(7, rank=0), steps.base_seed, steps.seed_source
            (True, 7, 'checkpoint')
            >>> steps.restore_env()
        """
        if self.seed_source != "drawn" or self.base_seed is None or int(base) == self.base_seed:
            return False
        self._adopt(int(base), rank, reseed=False)
        self._source = "taken from the resumed checkpoint, as this run drew its own"
        self.seed_source = "checkpoint"
        return True

    def _adopt(self, base: int, rank: int, reseed: bool = True) -> None:
        self.base_seed = base
        self.local_seed = stream_seeds(base, self.topology)["default"] if self.topology else base + rank
        os.environ["PL_GLOBAL_SEED"] = str(base)
        if reseed:
            # The base seed, not the offset one, until the model exists: initialisation must agree across ranks.
            seed_all(base)
        _record_seeds(base, base)

    def announce(self, rank: int) -> None:
        """Print the agreed seed once (rank 0) and each rank's seeds (the package's logger)."""
        # Once, where Lightning prints "Seed set to ...": enough to reproduce an unseeded run from its log.
        rank_zero_info(f"Seed set to {self.base_seed} by lightning_determinism ({self._source})")
        log.info(
            rank_prefixed_message(
                f"lightning_determinism: base seed {self.base_seed}, local seed {self.local_seed},"
                f" debug_mode={self.debug_mode_name}",
                rank,
            )
        )

    def model_built(self, rank: int) -> None:
        """Step 2: seed this rank's training-time streams (``base + rank``, or the topology's)."""
        if self.base_seed is None:
            raise RuntimeError("the base seed is unknown: the strategy's setup_environment() has not run")
        if self.topology is not None:
            model_parallel_seed(self.base_seed, self.topology, distinct_data_parallel=self.distinct_data_parallel)
        else:
            local = self.base_seed + rank
            seed_all(local)
            _record_seeds(self.base_seed, local)

    def restore_env(self) -> None:
        """Put back the variables the strategy set (``PL_GLOBAL_SEED``, the package's seeds, cuBLAS's workspace).

        DTensor's own random ops come back too (the mesh rule routed them).

        Set during the run, they reach data-loader workers and child processes; left behind, a drawn seed would
        turn Lightning's ``reset_seed()`` (a no-op without ``seed_everything``) into a reseed and be silently
        reused by a later ``seed_everything()``.
        """
        if self.dtensor_random_routed:
            dtensor_random.uninstall()
            self.dtensor_random_routed = False
        saved, self.saved_env = self.saved_env, {}
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class SeedingProperties:
    """What the deterministic strategies (Trainer and Fabric) show of their :class:`SeedingSteps`."""

    _ldet_steps: SeedingSteps

    @property
    def seed(self) -> int | None:
        """The seed the user passed (``None`` if it is to be taken from ``PL_GLOBAL_SEED`` or drawn)."""
        return self._ldet_steps.seed

    @property
    def debug_mode(self) -> str:
        """The debug mode as a name: ``"None"``, ``"default"``, ``"warn"`` or ``"error"``."""
        return self._ldet_steps.debug_mode_name

    @property
    def base_seed(self) -> int | None:
        """The base seed all ranks agreed on; ``None`` until the ranks are known (set up / ``launch()``)."""
        return self._ldet_steps.base_seed

    @property
    def local_seed(self) -> int | None:
        """The seed of this rank's training-time streams.

        ``base_seed + global_rank``, or with a topology the ``default`` seed of
        :func:`~lightning_determinism.parallel.topology.stream_seeds`; ``None`` until the ranks are known.
        """
        return self._ldet_steps.local_seed

    @property
    def topology(self) -> Topology | None:
        """The parallel topology of this rank (built from the degrees given once ranks are known), or ``None``."""
        return self._ldet_steps.topology


__all__ = ["CUBLAS_ENV", "SEED_ENV", "SeedingProperties", "SeedingSteps"]
