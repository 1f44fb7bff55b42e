"""The module paths of the flat layout (before 0.2), importable for one release with a ``DeprecationWarning``.

``import lightning_determinism.rng`` gives :mod:`lightning_determinism.seeding.rng` itself (one module object, so
``isinstance`` checks and patches agree) and says where it moved. Names imported from the package's top level never
moved. A leaf: it imports nothing of the package.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

MOVED = {
    "strategies": "strategies.trainer",
    "fabric": "strategies.fabric",
    "launchers": "strategies.launchers",
    "seeding_steps": "strategies.seeding_steps",
    "strategy_arguments": "strategies.arguments",
    "model_parallel_strategy": "strategies.model_parallel",
    "seeding": "seeding.seeds",
    "_seed_hash": "seeding._hash",
    "backends": "seeding.backends",
    "rank_states": "seeding.rank_states",
    "rng": "seeding.rng",
    "isolation": "seeding.isolation",
    "topology": "parallel.topology",
    "mesh_seeding": "parallel.mesh",
    "invariant": "invariance.invariant",
    "tree": "invariance.tree",
    "elastic": "invariance.elastic",
    "atomic_file": "checkpoints.atomic",
    "checkpoint_io": "checkpoints.io",
    "checkpoint_file": "checkpoints.file",
    "checkpoint_integrity": "checkpoints.integrity",
    "fingerprint": "divergence.fingerprint",
    "baseline_file": "divergence.baseline_file",
    "baseline_recorder": "divergence.baseline_recorder",
    "_compare_plot": "divergence._compare_plot",
    "cli": "divergence.cli",
    "_compat": "_compat.checks",
    "_compat_data": "_compat.data",
    "diagnosis": "divergence.diagnosis",
}
"""Old module (below the package) -> where it lives now. Old names that are folders now (``strategies``, ``seeding``)
are folders: their modules' public names are imported from the new module paths or from the top level."""

_PACKAGE = "lightning_determinism"
# Folders now (imported as they are), and `fingerprint`, which names the public function at the top level: importing
# an alias sets the package's attribute of that name to the module, which would hide the function.
_NOT_ALIASED = ("strategies", "seeding", "_compat", "fingerprint")


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolve ``lightning_determinism.<old>`` (and ``<old>.<sub>``) to the module's new path, with a warning."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        new = _new_name(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> ModuleType:
        new = _new_name(spec.name)
        warnings.warn(
            f"`{spec.name}` moved to `{new}` (lightning_determinism 0.2: one folder per concept); the old path works"
            " for this release only: import from the new path or from `lightning_determinism`",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(new)  # type: ignore[arg-type]
        sys.modules[spec.name] = module
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module is the new one, already imported."""


def _new_name(fullname: str) -> str | None:
    """The new path of an old module path, or ``None``; an old name that is a package of its own now is no alias.

    Examples:
        >>> _new_name("lightning_determinism.rng")
        'lightning_determinism.seeding.rng'
        >>> _new_name("lightning_determinism.diagnosis.digest")
        'lightning_determinism.divergence.diagnosis.digest'
        >>> _new_name("lightning_determinism.seeding") is None  # a folder now: imported as it is
        True
    """
    prefix = _PACKAGE + "."
    if not fullname.startswith(prefix):
        return None
    head, _, rest = fullname[len(prefix) :].partition(".")
    if head not in MOVED or head in _NOT_ALIASED:
        return None
    return prefix + MOVED[head] + (f".{rest}" if rest else "")


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedModuleFinder())  # before the path finder, which would load a second copy


__all__ = ["MOVED", "install"]
