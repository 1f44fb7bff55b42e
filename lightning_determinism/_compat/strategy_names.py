"""Lightning's refusal of an unknown strategy name, with the closest deterministic name added where one was meant.

A leaf of ``_compat``: it wraps one private method of Lightning (listed in
:data:`~lightning_determinism._compat.pieces.PIECES`), and nothing else of the package.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def suggest_strategy_names(names: Callable[[], list[str]]) -> bool:
    """Have the Trainer name the closest of ``names()`` when it refuses a strategy name that says "determin(istic)".

    Lightning checks ``Trainer(strategy=...)`` against its registry and refuses an unknown name with a generic list of
    examples; a mistyped deterministic name (``ddp_find_unused_parameters_true_determinstic``) then gets no hint. The
    check (``_AcceleratorConnector._check_config_and_set_final_flags``) is wrapped once: its error is kept, with
    "Did you mean ...?" added for such names; every other name and error is Lightning's, unchanged.

    Returns:
        Whether the check is wrapped (``False`` where this Lightning has no such check: the hint is only missing).
    """
    import difflib
    import functools

    from lightning.pytorch.trainer.connectors import accelerator_connector as module

    owner = getattr(module, "_AcceleratorConnector", None)
    original = None if owner is None else owner.__dict__.get("_check_config_and_set_final_flags")
    if original is None:
        return False
    if getattr(original, "_ldet_suggests", False):
        return True

    @functools.wraps(original)
    def check(self: Any, strategy: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, strategy, *args, **kwargs)
        except ValueError as error:
            if not (isinstance(strategy, str) and "determin" in strategy.lower() and "strategy name" in str(error)):
                raise
            close = difflib.get_close_matches(strategy.lower(), names(), n=1, cutoff=0.6)
            if not close:
                raise
            raise ValueError(f"{error} Did you mean {close[0]!r}?") from None

    check._ldet_suggests = True  # type: ignore[attr-defined]
    owner._check_config_and_set_final_flags = check  # type: ignore[union-attr]
    return True


__all__ = ["suggest_strategy_names"]
