"""torch's operator registry: taking back the kernels that batch-invariant evaluation registers over ATen's.

``torch.library.Library("aten", "IMPL")`` is the public way to register a kernel over an existing one; taking the
registrations back before the object is collected has only the private ``Library._destroy`` (dropping the last
reference does it too, but only when the garbage collector gets to it). A leaf: imports nothing of the package but the
error type.
"""

from __future__ import annotations

from typing import Any

from lightning_determinism._compat.checks import _message
from lightning_determinism.errors import IncompatibleVersionError


def destroy_library(library: Any) -> None:
    """Take back every kernel ``library`` registered, now (the kernels it replaced are in force again)."""
    destroy = getattr(library, "_destroy", None)
    if destroy is None:
        raise IncompatibleVersionError(_message(["`torch.library.Library._destroy` (read at run time)"]))
    destroy()
