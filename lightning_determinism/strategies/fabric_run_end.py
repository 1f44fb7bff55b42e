"""The end of a Fabric run: what the deterministic Fabric strategies set in the process is put back there.

Fabric never calls its strategy's ``teardown``: ``PL_GLOBAL_SEED``, ``LDET_BASE_SEED``, ``LDET_LOCAL_SEED`` (and, where
CUDA is, ``CUBLAS_WORKSPACE_CONFIG``) set at ``fabric.launch()`` stayed in the user's process after the run, where a
later ``seed_everything()`` or a later run read them. A run's real end in Fabric is the return of the function it
launched — ``fabric.launch(train)`` (and Fabric's ``run`` method): :class:`RunEndLauncher` wraps the strategy's launcher
(or stands in for the missing one of a single device) and restores the environment in this process when that function
returns or raises. Forked and spawned ranks are processes of their own (their environment ends with them); in the
process that launches them, :class:`RunEndMultiProcessingLauncher` puts back what the strategy set there before they
started. ``fabric.launch()`` without a function has no end that Fabric sees: the variables go with the process
(docs/record.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_determinism._compat.access import launches_nothing, swap_launcher
from lightning_determinism._compat.checks import FabricMultiProcessingLauncher


class RunEndLauncher:
    """A Fabric launcher (or none) whose launched function's return ends the run: ``restore()`` is called then.

    Examples:
        >>> ended = []
        >>> RunEndLauncher(None, lambda: ended.append(True)).launch(lambda fabric: "done", None), ended
        ('done', [True])
    """

    def __init__(self, launcher: Any, restore: Callable[[], None]) -> None:
        self.launcher = launcher
        self.restore = restore

    @property
    def is_interactive_compatible(self) -> bool:
        """As the wrapped launcher's; a single device's (none) runs anywhere."""
        return bool(self.launcher.is_interactive_compatible) if self.launcher is not None else True

    def launch(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Launch as the wrapped launcher does (or call ``function`` here); restore when it returns."""
        ends = not launches_nothing(function)
        try:
            if self.launcher is None:
                return function(*args, **kwargs)
            return self.launcher.launch(function, *args, **kwargs)
        finally:
            if ends:
                self.restore()

    def __getattr__(self, name: str) -> Any:
        launcher = self.__dict__.get("launcher")
        if launcher is None:
            raise AttributeError(name)
        return getattr(launcher, name)


class RunEndMultiProcessingLauncher(FabricMultiProcessingLauncher):
    """Fabric's fork/spawn launcher (its class kept: Fabric's ``launch()`` tells it by its class), and the run's end.

    The ranks are processes of their own; in the launching process the strategy set only what it sets before the
    ranks start (``CUBLAS_WORKSPACE_CONFIG`` where CUDA is), put back when they are done.
    """

    _ldet_steps: Any = None

    def launch(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Set what the ranks inherit, launch them as Fabric does, restore it here when they are done."""
        steps = self._ldet_steps
        if steps is not None:
            steps.prepare_launch()
        try:
            return super().launch(function, *args, **kwargs)
        finally:
            if steps is not None:
                steps.restore_env()


def end_run_with_launch(strategy: Any, steps: Any) -> None:
    """Give a Fabric strategy's launcher the run's end: ``steps`` (its ``SeedingSteps``) restores the environment."""
    swap_launcher(strategy, lambda launcher: _with_run_end(launcher, steps))


def _with_run_end(launcher: Any, steps: Any) -> Any:
    if isinstance(launcher, FabricMultiProcessingLauncher):
        ending = RunEndMultiProcessingLauncher.__new__(RunEndMultiProcessingLauncher)
        ending.__dict__.update(launcher.__dict__)
        ending._ldet_steps = steps
        return ending
    return RunEndLauncher(launcher, steps.restore_env)


__all__ = ["RunEndLauncher", "RunEndMultiProcessingLauncher", "end_run_with_launch"]
