"""Where the compiled C kernels live, and what is trusted there: nothing another user could have written.

The default directory, ``<tempdir>/lightning_determinism-<user>``, has a predictable name on a machine many users
share: another user could create it first, writable by all, and put a library there under the name a kernel would be
loaded from. So the directory is created private (0700), and before anything is built into it or loaded from it, it
must be a real directory (no link) owned by this user that no one else can write (:func:`untrusted`); one that is not
is never used: the process takes a new private directory instead and says so once. Each library is checked the same
way just before it is loaded (:func:`load_trusted`). docs/security.md has the whole picture.
"""

from __future__ import annotations

import atexit
import ctypes
import getpass
import os
import shutil
import stat
import tempfile
import threading
import warnings

from lightning_determinism.errors import DeterminismWarning

CACHE_ENV = "LDET_KERNEL_CACHE"
"""Directory of the compiled kernels; default ``<tempdir>/lightning_determinism-<user>``."""


def _default_cache_dir() -> str:
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return explicit
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001  (no user name in some containers)
        user = str(os.getuid()) if hasattr(os, "getuid") else "user"
    return os.path.join(tempfile.gettempdir(), f"lightning_determinism-{user}")


def untrusted(path: str, directory: bool) -> str | None:
    """Why ``path`` must not be loaded from (or built into), or ``None`` when only this user can have written it.

    Trusted: a directory (``directory=True``) or a regular file, not a symbolic link, owned by this user, that neither
    its group nor others can write. Where the platform has no owners (Windows) nothing is refused.
    """
    if not hasattr(os, "getuid"):
        return None
    try:
        info = os.lstat(path)
    except OSError as error:
        return f"cannot be read ({error.strerror})"
    kind = stat.S_ISDIR(info.st_mode) if directory else stat.S_ISREG(info.st_mode)
    if not kind:
        return "is a link or not a " + ("directory" if directory else "regular file")
    if info.st_uid != os.getuid():
        return f"is owned by uid {info.st_uid}, not by this user (uid {os.getuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"can be written by other users (mode {stat.S_IMODE(info.st_mode):o})"
    return None


_CACHE: dict[str, str] = {}  # the default directory -> the directory this process uses for it
_CACHE_LOCK = threading.Lock()


def cache_dir() -> str:
    """The kernel cache this process uses: :data:`CACHE_ENV` or the default, created private (0700).

    Where that one fails :func:`untrusted` (another user made it first, or may write it), a new private one, said once.
    """
    wanted = _default_cache_dir()
    with _CACHE_LOCK:
        used = _CACHE.get(wanted)
        if used is not None and used != wanted:
            return used  # the replacement made earlier in this process
        try:
            os.makedirs(wanted, mode=0o700, exist_ok=True)
        except OSError:
            pass  # untrusted() says why
        why = untrusted(wanted, directory=True)
        if why is None:
            if hasattr(os, "chmod"):
                os.chmod(wanted, 0o700)  # one an older release made 0755: readable by all, now private too
            _CACHE[wanted] = wanted
            return wanted
        replacement = tempfile.mkdtemp(prefix="lightning_determinism-kernels-")  # 0700, ours
        atexit.register(_remove_replacement, replacement, os.getpid())  # one per process: not left behind
        _CACHE[wanted] = replacement
        warnings.warn(
            f"the kernel cache {wanted} {why}: another user could put code there that this process would load;"
            f" using {replacement} instead for this process (set {CACHE_ENV} to a private directory to keep compiled"
            " kernels between runs)",
            DeterminismWarning,
            stacklevel=2,
        )
        return replacement


def _remove_replacement(path: str, owner_pid: int) -> None:
    """At exit of the process that made it (forked children, which share it, leave it to their parent)."""
    if os.getpid() == owner_pid:
        shutil.rmtree(path, ignore_errors=True)


def load_trusted(target: str) -> ctypes.CDLL:
    """``ctypes.CDLL(target)``, once :func:`untrusted` finds nothing against the file (checked just before)."""
    why = untrusted(target, directory=False)
    if why is not None:
        raise OSError(f"{target} {why}: not loaded")
    return ctypes.CDLL(target)


__all__ = ["CACHE_ENV", "cache_dir", "load_trusted", "untrusted"]
