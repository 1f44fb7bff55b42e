"""Process-level helpers used everywhere: rank and world size, dying with the parent (a leaf: no Lightning)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

import torch.distributed as dist

_PR_SET_PDEATHSIG = 1


def _rank_and_world_size() -> tuple[int, int]:
    """Rank and world size of the default process group, or ``(0, 1)`` without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def distributed() -> bool:
    """Whether a process group of more than one rank is running (there is someone to communicate with)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def die_with_parent(parent_pid: int) -> bool:
    """Have the kernel kill this process when its parent dies; exit now if the parent is already gone.

    Linux only (``prctl``); elsewhere nothing happens and ``False`` is returned.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent_pid:  # the parent died before the request was in place
        os._exit(1)
    return True


__all__ = ["die_with_parent"]
