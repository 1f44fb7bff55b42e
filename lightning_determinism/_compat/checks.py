"""Every private name of Lightning, Fabric, torch and torchmetrics the package relies on, checked feature by feature.

No public API serves these needs (each entry of :data:`PIECES` says why). Each piece belongs to one feature of
:data:`FEATURES`; importing the package never fails for a missing one. A feature checks its pieces when it is turned on
(:func:`require`: a strategy's construction, a callback's, an exact metric's, the first use) and refuses in one line
naming the feature, the installed versions and the versions where it works; everything else keeps working.
:func:`check_compat` checks them all at once (the suite's first test does; a user can, to see what a release moved).
Attributes that exist only on instances are checked from the code of the ``__init__`` that assigns them, and again
where they are read (the accessors of :mod:`~lightning_determinism._compat.access`).
The tested versions: ``docs/compatibility.md``.
"""

from __future__ import annotations

import importlib
from typing import Any

import lightning
import torch
import torchmetrics

from lightning_determinism.__about__ import __version__
from lightning_determinism._compat.features import FEATURES, LIGHTNING_FLOOR
from lightning_determinism._compat.pieces import PIECES, Piece
from lightning_determinism.errors import IncompatibleVersionError


class _Missing:
    """Stands in for a private class or function this torch or Lightning lacks.

    The import of the package goes on, and the feature that needs it refuses when it is turned on (:func:`require`);
    a direct use raises the same error.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise IncompatibleVersionError(_missing_message(type(self).__qualname__))


def _optional(path: str) -> Any:
    """``"module:name"`` -> the object, or a :class:`_Missing` subclass (a function too: calling it raises)."""
    module, _, name = path.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return type(name, (_Missing,), {"__qualname__": f"{module}.{name}"})


FabricMultiProcessingLauncher = _optional(
    "lightning.fabric.strategies.launchers.multiprocessing:_MultiProcessingLauncher"
)
set_sampler_epoch = _optional("lightning.fabric.utilities.data:_set_sampler_epoch")
suggested_max_num_threads = _optional("lightning.fabric.utilities.distributed:_suggested_max_num_threads")
FabricDataLoader = _optional("lightning.fabric.wrappers:_FabricDataLoader")
MultiProcessingLauncher = _optional("lightning.pytorch.strategies.launchers.multiprocessing:_MultiProcessingLauncher")
SubprocessScriptLauncher = _optional(
    "lightning.pytorch.strategies.launchers.subprocess_script:_SubprocessScriptLauncher"
)
update_dataloader = _optional("lightning.pytorch.utilities.data:_update_dataloader")
maybe_mark_dynamic = _optional("torch._dynamo.decorators:maybe_mark_dynamic")
BatchNorm = _optional("torch.nn.modules.batchnorm:_BatchNorm")
worker_module: Any = importlib.import_module("torch.utils.data._utils.worker")  # public module, private names inside
AX_TYPE: Any = _optional("torchmetrics.utilities.plot:_AX_TYPE")
PLOT_OUT_TYPE: Any = _optional("torchmetrics.utilities.plot:_PLOT_OUT_TYPE")
if isinstance(AX_TYPE, type) and issubclass(AX_TYPE, _Missing):  # only annotations use them
    AX_TYPE = PLOT_OUT_TYPE = Any


def versions() -> str:
    """The installed versions that matter here, for messages."""
    return f"lightning {lightning.__version__}, torchmetrics {torchmetrics.__version__}, torch {torch.__version__}"


def _message(missing: list[str]) -> str:
    listed = "".join(f"\n  - {item}" for item in missing)
    return (
        f"lightning_determinism {__version__} cannot run with the installed {versions()}; what it relies on is"
        f" missing or changed:{listed}\nInstall a tested combination (docs/compatibility.md: lightning>="
        f"{LIGHTNING_FLOOR}; the newest tested is in the README) or report this version."
    )


def _missing_message(name: str) -> str:
    feature = next((piece.feature for piece in PIECES if name.rsplit(".", 1)[-1] in piece.name), None)
    where = f" ({feature}, tested with {FEATURES[feature]})" if feature else ""
    return f"`{name}` is missing from the installed {versions()}{where}; see docs/compatibility.md"


def missing(feature: str | None = None) -> list[Piece]:
    """The pieces that are missing or changed in the installed versions (of one feature, or of all).

    Examples:
        >>> from lightning_determinism._compat.features import METRICS, TRAINER
        >>> missing(TRAINER)  # the installed versions are fine
        []
    """
    if feature is not None and feature not in FEATURES:
        raise ValueError(f"`feature` must be one of {sorted(FEATURES)}, got {feature!r}")
    return [piece for piece in PIECES if feature in (None, piece.feature) and not piece.present()]


_REQUIRED: set[str] = set()  # features found complete once: a second require() costs a set lookup


def require(feature: str) -> None:
    """Refuse, in one line, to turn on a feature whose private pieces this torch, Lightning or torchmetrics lacks.

    Raises:
        IncompatibleVersionError: naming the feature, the installed versions, the versions where it works and the
            first missing piece.

    Examples:
        >>> from lightning_determinism._compat.features import METRICS
        >>> require(METRICS)  # present: returns nothing
    """
    if feature in _REQUIRED:
        return
    gone = missing(feature)
    if gone:
        names = "; ".join(piece.name for piece in gone)
        raise IncompatibleVersionError(
            f"lightning_determinism: {feature} cannot run with the installed {versions()}: {names} is missing or"
            f" changed (it works with {FEATURES[feature]}; docs/compatibility.md)"
        )
    _REQUIRED.add(feature)


def available(feature: str) -> bool:
    """Whether :func:`require` would let ``feature`` run (no error raised)."""
    try:
        require(feature)
    except IncompatibleVersionError:
        return False
    return True


def check_compat() -> None:
    """Check that every private name the package needs still exists with the expected shape (every feature).

    Importing the package does not call it: each feature checks its own pieces when it is turned on (:func:`require`).

    Raises:
        IncompatibleVersionError: naming the installed versions and every missing piece with its feature and purpose.

    Examples:
        >>> check_compat() if not missing() else None  # raises only where a piece is missing
    """
    gone = missing()
    if gone:
        raise IncompatibleVersionError(_message([f"{piece.name} ({piece.feature}): {piece.why}" for piece in gone]))


__all__ = [
    "AX_TYPE",
    "BatchNorm",
    "FEATURES",
    "FabricDataLoader",
    "FabricMultiProcessingLauncher",
    "LIGHTNING_FLOOR",
    "MultiProcessingLauncher",
    "PIECES",
    "PLOT_OUT_TYPE",
    "Piece",
    "SubprocessScriptLauncher",
    "available",
    "check_compat",
    "maybe_mark_dynamic",
    "missing",
    "require",
    "set_sampler_epoch",
    "suggested_max_num_threads",
    "update_dataloader",
    "versions",
]
