"""The Trainer strategies' names in Lightning's ``StrategyRegistry``: ``ddp_deterministic`` and its kin.

Registered on import of the package (:func:`register_strategies`); a mistyped deterministic name gets the closest
registered one suggested (:mod:`~lightning_determinism._compat.strategy_names`).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

from lightning_determinism._compat.strategy_names import suggest_strategy_names
from lightning_determinism.strategies.trainer import (
    DeterministicDDPStrategy,
    DeterministicFSDPStrategy,
    DeterministicSingleDeviceStrategy,
)

_REGISTRATIONS: tuple[tuple[str, type, dict[str, Any]], ...] = (
    ("ddp_deterministic", DeterministicDDPStrategy, {"start_method": "popen"}),
    ("ddp_spawn_deterministic", DeterministicDDPStrategy, {"start_method": "spawn"}),
    ("ddp_fork_deterministic", DeterministicDDPStrategy, {"start_method": "fork"}),
    ("ddp_notebook_deterministic", DeterministicDDPStrategy, {"start_method": "fork"}),
    ("fsdp_deterministic", DeterministicFSDPStrategy, {}),
    ("single_device_deterministic", DeterministicSingleDeviceStrategy, {"device": "cpu"}),
    # Lightning's names for DDP with find_unused_parameters (its advice when a parameter gets no gradient), each with
    # a deterministic twin: ddp_find_unused_parameters_true_deterministic, ddp_spawn_..._false_deterministic, ...
    *(
        (f"{launch}_find_unused_parameters_{str(flag).lower()}_deterministic", DeterministicDDPStrategy,
         {"start_method": method, "find_unused_parameters": flag})
        for launch, method in (("ddp", "popen"), ("ddp_spawn", "spawn"), ("ddp_fork", "fork"), ("ddp_notebook", "fork"))
        for flag in (True, False)
    ),
)  # fmt: skip


def register_strategies() -> list[str]:
    """Register the deterministic strategies in Lightning's ``StrategyRegistry``; safe to call again.

    Returns:
        The registered names.

    Examples:
        >>> "ddp_deterministic" in register_strategies()
        True
    """
    for name, cls, init_params in _REGISTRATIONS:
        StrategyRegistry.register(
            name,
            cls,
            description=f"{cls.__name__} {init_params or ''}".strip(),
            override=True,
            **init_params,
        )
    suggest_strategy_names(lambda: [name for name in StrategyRegistry.available_strategies() if "determin" in name])
    return [name for name, _, _ in _REGISTRATIONS]


__all__ = ["register_strategies"]
