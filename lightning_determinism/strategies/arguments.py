"""Checks of a deterministic strategy's arguments that need no rank: at construction and before the launch.

A misspelt keyword (``sed=42``) would otherwise travel through Lightning's strategy into the module wrapper (DDP,
FSDP) and fail at ``fit`` in every rank, and a seed or topology that does not fit the world size would be refused only
once each rank exists, as one traceback per rank. Everything that can be checked from the constructor's arguments or
from the Trainer's devices and nodes is checked here, in the main process, once.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any

from lightning_determinism._compat.checks import require
from lightning_determinism._compat.features import INVARIANT
from lightning_determinism.invariance.invariant import InvariantTraining
from lightning_determinism.seeding.seeds import check_seed

_FORWARDED_TO = {
    # Lightning strategy class name -> the wrapper its **kwargs are forwarded to (module path, class name)
    "DDPStrategy": ("torch.nn.parallel", "DistributedDataParallel"),
    "FSDPStrategy": ("torch.distributed.fsdp", "FullyShardedDataParallel"),
}


def _parameters(function: Any) -> tuple[set[str], bool]:
    """Named parameters of ``function`` (not ``self`` or ``*args``) and whether it takes ``**kwargs``."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return set(), True
    named = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"}
    return named, any(p.kind is p.VAR_KEYWORD for p in parameters)


def accepted_keywords(cls: type, mixin: type) -> set[str] | None:
    """The keywords ``cls`` (a strategy with ``mixin`` in front) accepts; ``None`` when they cannot be known.

    The mixin's own, the Lightning strategy's, and, where the strategy forwards the rest to a wrapper it names
    (``DDPStrategy`` to ``DistributedDataParallel``, ``FSDPStrategy`` to ``FullyShardedDataParallel``), the wrapper's.

    Examples:
        >>> from lightning_determinism.strategies.trainer import DeterministicDDPStrategy, DeterministicStrategyMixin
        >>> names = accepted_keywords(DeterministicDDPStrategy, DeterministicStrategyMixin)
        >>> {"seed", "start_method", "find_unused_parameters"} <= names, "sed" in names
        (True, False)
    """
    names, _ = _parameters(vars(mixin)["__init__"])
    strategy = next((base for base in cls.__mro__ if not issubclass(base, mixin) and "__init__" in vars(base)), None)
    if strategy is None:
        return None
    own, forwards = _parameters(strategy.__init__)
    names |= own
    if not forwards:
        return names
    target = next((_FORWARDED_TO[base.__name__] for base in strategy.__mro__ if base.__name__ in _FORWARDED_TO), None)
    if target is None:
        return None  # forwarded somewhere we do not know: let the strategy judge
    module = __import__(target[0], fromlist=[target[1]])
    wrapper, more = _parameters(getattr(module, target[1]).__init__)
    return None if more else names | (wrapper - {"module"})


def check_keywords(cls: type, mixin: type, kwargs: dict[str, Any]) -> None:
    """Refuse keywords that neither the mixin, the strategy nor its wrapper accepts, listing the accepted ones.

    Raises:
        TypeError: naming the unknown keywords and the accepted ones.
    """
    accepted = accepted_keywords(cls, mixin)
    unknown = sorted(set(kwargs) - accepted) if accepted is not None else []
    if unknown:
        listed = ", ".join(repr(name) for name in unknown)
        close = [match for name in unknown for match in difflib.get_close_matches(name, accepted, n=1)]  # type: ignore[arg-type]
        hint = f" (did you mean {', '.join(repr(name) for name in close)}?)" if close else ""
        raise TypeError(
            f"{cls.__name__} got unexpected keyword argument(s) {listed}{hint}; it accepts:"
            f" {', '.join(sorted(accepted))}"  # type: ignore[arg-type]
        )


def invariant_training(
    global_batch_size: int | None, micro_batch_size: int | None, threads: int, steps: Any, debug_mode: Any,
    topology: Any,
) -> InvariantTraining | None:  # fmt: skip
    """The invariant mode the Trainer's and Fabric's strategies were asked for (``None``: neither size given).

    Raises:
        ValueError: for one of the two sizes alone, kernels not deterministic (``steps``: SeedingSteps), a topology,
            or sizes :class:`~lightning_determinism.invariance.invariant.InvariantTraining` refuses.

    Examples:
        >>> from lightning_determinism.strategies.seeding_steps import SeedingSteps
        >>> invariant_training(8, 2, 1, SeedingSteps(None, "warn", None), "warn", None).micro_batches
        4
    """
    if global_batch_size is None and micro_batch_size is None:
        return None
    require(INVARIANT)
    if global_batch_size is None or micro_batch_size is None:
        raise ValueError(
            "world-size-invariant training needs both `global_batch_size` and `micro_batch_size`, got"
            f" global_batch_size={global_batch_size!r}, micro_batch_size={micro_batch_size!r}"
        )
    if steps.debug_mode not in (1, 2):
        raise ValueError(
            "world-size-invariant training needs deterministic kernels: `debug_mode` must be 'warn' or"
            f" 'error', got {debug_mode!r}"
        )
    if topology is not None:
        raise ValueError("world-size-invariant training is data-parallel only: pass no `topology`")
    return InvariantTraining(global_batch_size, micro_batch_size, threads)


_FROM_DETERMINISTIC = {True: 2, "warn": 1, False: 0}
_FLAG_OF_MODE = {2: "True", 1: "'warn'", 0: "False"}


def follow_trainer_flags(steps: Any, invariant: Any, flags: tuple[Any, Any] | None, owner: str) -> str | None:
    """Reconcile the Trainer's ``deterministic`` and ``benchmark`` with the strategy's ``debug_mode`` (``steps``).

    One rule: a flag the user gave explicitly is never silently overridden. ``deterministic`` decides the mode where
    the strategy was given none (``True``: ``"error"``, ``"warn"``, ``False``: ``"default"``); where both were given
    they must agree. ``benchmark=True`` (cuDNN picks algorithms by timing) is kept under ``"default"`` and refused
    under ``"warn"``/``"error"``; ``debug_mode=None`` leaves every flag to the Trainer.

    Returns:
        The line to say when a Trainer flag decided something, else ``None``.

    Raises:
        ValueError: for a contradiction, naming both arguments and how to resolve it.

    Examples:
        >>> from lightning_determinism.strategies.seeding_steps import SeedingSteps
        >>> steps = SeedingSteps()
        >>> follow_trainer_flags(steps, None, ("warn", None), "DeterministicDDPStrategy")
        "Trainer(deterministic='warn'): DeterministicDDPStrategy's debug_mode is 'warn'"
        >>> steps.debug_mode
        1
    """
    steps.debug_mode, steps.benchmark = steps.asked_debug_mode, None
    if flags is None or steps.asked_debug_mode is None:
        return None
    deterministic, benchmark = flags
    said = None
    if deterministic is not None:
        wanted = _FROM_DETERMINISTIC.get(deterministic)
        if wanted is None:
            return None  # Lightning refuses it itself
        if steps.debug_mode_given and wanted != steps.asked_debug_mode:
            raise ValueError(
                f"Trainer(deterministic={deterministic!r}) contradicts {owner}(debug_mode={steps.debug_mode_name!r}):"
                f" give one of them, or both alike (deterministic=True is debug_mode='error', 'warn' is 'warn',"
                f" False is 'default')"
            )
        if not steps.debug_mode_given and wanted != steps.debug_mode:
            steps.debug_mode = wanted
            said = f"Trainer(deterministic={deterministic!r}): {owner}'s debug_mode is {steps.debug_mode_name!r}"
    if invariant is not None and steps.debug_mode not in (1, 2):
        raise ValueError(
            f"world-size-invariant training needs deterministic kernels: Trainer(deterministic={deterministic!r})"
            " turns them off; leave it out or pass True or 'warn'"
        )
    if benchmark is True and steps.debug_mode in (1, 2):
        raise ValueError(
            f"Trainer(benchmark=True) lets cuDNN pick its algorithms by timing, which contradicts"
            f" {owner}(debug_mode={steps.debug_mode_name!r}) (deterministic kernels): leave benchmark out, or pass"
            " debug_mode='default' to the strategy"
        )
    if benchmark is not None:
        steps.benchmark = bool(benchmark)
    return said


def check_planned_world(steps: Any, world_size: int) -> None:
    """The seed and the topology degrees against the world size the Trainer will launch (``steps``: SeedingSteps).

    Raises:
        ValueError: for a ``seed`` whose ``seed + rank`` leaves the seed range, or degrees that do not multiply to
            ``world_size``, naming the argument.
    """
    if steps.seed is not None:
        check_seed(steps.seed, world_size)
    spec = steps.topology_spec
    if isinstance(spec, dict):
        from lightning_determinism.parallel.topology import Topology

        try:
            Topology(0, world_size, **spec)
        except ValueError as error:
            raise ValueError(
                f"`topology={spec}` does not fit the {world_size} processes that will be launched: {error}"
            ) from None


def check_mesh_sizes(sizes: tuple[Any, Any], num_nodes: int, world_size: int | None, invariant: bool) -> None:
    """``(data_parallel_size, tensor_parallel_size)`` as given to a ``ModelParallelStrategy``, checked before launch.

    Each is ``"auto"`` or a positive int; the invariant mode needs ``tensor_parallel_size=1``; with ``world_size`` (the
    processes the launcher will start) the sizes, ``"auto"`` resolved as Lightning resolves it, must multiply to it.

    Raises:
        ValueError: naming the argument, the expected value and the one received.

    Examples:
        >>> check_mesh_sizes(("auto", 2), num_nodes=1, world_size=2, invariant=False)
        >>> check_mesh_sizes((1, 3), num_nodes=1, world_size=2, invariant=False)
        Traceback (most recent call last):
        ...
        ValueError: `data_parallel_size=1` x `tensor_parallel_size=3` (resolved: 1 x 3 = 3) must equal the 2 processes the launcher starts (devices=2 x num_nodes=1)
    """  # noqa: E501
    for name, size in zip(("data_parallel_size", "tensor_parallel_size"), sizes, strict=True):
        if size != "auto" and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"`{name}` must be 'auto' or a positive int, got {size!r}")
    given_dp, given_tp = sizes
    tp = given_tp
    if world_size is not None:
        devices = world_size // max(int(num_nodes), 1)
        dp = num_nodes if given_dp == "auto" else given_dp
        tp = devices if given_tp == "auto" else given_tp
        if dp * tp != world_size:
            raise ValueError(
                f"`data_parallel_size={given_dp}` x `tensor_parallel_size={given_tp}` (resolved: {dp} x {tp} ="
                f" {dp * tp}) must equal the {world_size} processes the launcher starts (devices={devices} x"
                f" num_nodes={num_nodes})"
            )
    if invariant and isinstance(tp, int) and tp > 1:
        raise ValueError(
            "world-size-invariant training (`global_batch_size`, `micro_batch_size`) runs on FSDP2 over data-parallel"
            f" ranks: it needs `tensor_parallel_size=1`, got {tp} (a tensor-parallel rank's micro-batches are not its"
            " own)"
        )


def refuse_per_worker_seeds(trainer: Any) -> None:
    """Refuse a ``WorkerSeedCallback(per_sample=False)`` in world-size-invariant training.

    Its workers draw from a (rank, worker, epoch) stream, so a sample's augmentation depends on which rank loads it:
    the weights would change with the number of processes, with no word said.

    Raises:
        ValueError: naming ``WorkerSeedCallback(per_sample=True)``.
    """
    from lightning_determinism.callbacks.worker_seed import WorkerSeedCallback

    if any(isinstance(cb, WorkerSeedCallback) and not cb.per_sample for cb in getattr(trainer, "callbacks", ())):
        raise ValueError(
            "world-size-invariant training (`global_batch_size`, `micro_batch_size`) needs"
            " `WorkerSeedCallback(per_sample=True)`, got `per_sample=False`: per-worker seeds follow the rank that"
            " loads a sample, so the weights would change with the number of processes"
        )


__all__ = [
    "accepted_keywords",
    "check_keywords",
    "check_mesh_sizes",
    "check_planned_world",
    "follow_trainer_flags",
    "refuse_per_worker_seeds",
]
