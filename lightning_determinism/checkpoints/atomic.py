"""Files written whole or not at all: a temporary file beside the target, synced to disk, renamed onto it.

A file written in place is left cut short when the process is killed or the disk fills mid-write, and a file written
elsewhere and then moved is copied, not renamed, when the two directories lie on different filesystems. Lightning's
own save writes through a temporary file in ``TMPDIR`` (typically a local disk) while checkpoints live on NFS or
Lustre, so a checkpoint with a fixed name such as ``preempted.ckpt`` can be destroyed by the very save meant to
replace it. :func:`write_atomically` instead:

1. writes a hidden temporary file in the target's own directory (``.NAME.PID.RANDOM.tmp``: no ``*.ckpt`` glob matches
   it, and the pid says which process left it);
2. flushes it and syncs it to disk (``os.fsync``);
3. renames it onto the final name with ``os.replace`` (atomic within one directory on POSIX filesystems, NFS included);
4. syncs the directory, so that the rename itself survives a power loss.

On any failure (``ENOSPC``, an exception of the writer, a ``KeyboardInterrupt``) the temporary file is removed and the
file under the final name is the previous one, byte for byte. Only a ``SIGKILL`` or a power loss during steps 1-2 leaves
the hidden temporary file behind, never a cut-short file under the final name; nothing is ever written to ``TMPDIR``.

This module is a leaf: it knows ``os``, nothing of torch or Lightning.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Callable
from typing import BinaryIO

_NAME_ROOM = 200
"""How much of the final name the temporary name keeps: with the pid and the suffix it stays under NAME_MAX (255)."""


def temporary_name(name: str) -> str:
    """The hidden name a write to ``name`` goes through, in the same directory: ``.NAME.PID.RANDOM.tmp``.

    Examples:
        >>> import os
        >>> temporary_name("step=4.ckpt").startswith(f".step=4.ckpt.{os.getpid()}.")
        True
        >>> temporary_name("step=4.ckpt").endswith(".tmp")
        True
    """
    # "_" spelt "-": Lightning takes every file whose name holds "ckpt_" (or "hpc_ckpt_") for a numbered HPC checkpoint
    # and reads the digits of the rest as its version, so a leftover .hpc_ckpt_1.ckpt.<pid>.<hex>.tmp would become
    # version 11489768452 and every later auto-resume would look for a file that does not exist.
    return f".{name[:_NAME_ROOM].replace('_', '-')}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


def write_atomically(path: str | os.PathLike[str], data: bytes | str | Callable[[BinaryIO], object]) -> None:
    """Write ``path`` whole or not at all (see the module's docstring); the parent directory is created if missing.

    The new file gets the mode of the file it replaces, else the one ``open(path, "w")`` would give it (``0o666``
    less the umask).

    Args:
        path: the final name of the file.
        data: the contents (a ``str`` is written as UTF-8), or a function that writes them to the binary file it is
            given (``lambda f: torch.save(obj, f)``).

    Raises:
        OSError: what the filesystem said (``ENOSPC``, ``EACCES``, ...) with ``path`` as its file name, after the
            temporary file was removed; also when the writer reported it as something else (torch's zip writer
            raises ``RuntimeError: unexpected pos`` on a full disk).

    Examples:
        >>> import pathlib, tempfile
        >>> target = pathlib.Path(tempfile.mkdtemp()) / "baseline.json"
        >>> write_atomically(target, '{"format": 1}')
        >>> target.read_text(), sorted(p.name for p in target.parent.iterdir())
        ('{"format": 1}', ['baseline.json'])
    """
    final = os.fspath(path)
    directory = os.path.dirname(final) or "."
    os.makedirs(directory, exist_ok=True)
    temporary = os.path.join(directory, temporary_name(os.path.basename(final)))
    # Created as open() would (0o666 less the umask), unlike tempfile.mkstemp's 0o600.
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as file:
            if callable(data):
                data(file)
            else:
                file.write(data.encode() if isinstance(data, str) else data)
            file.flush()
            os.fsync(file.fileno())
        _keep_mode(final, temporary)
        os.replace(temporary, final)
    except BaseException as err:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        cause = _os_error(err)
        if cause is None:
            raise
        # One error naming the file: torch's zip writer reports a full disk as "unexpected pos 832 vs 726".
        raise (
            type(cause)(cause.errno, cause.strerror, final) if cause.errno else type(cause)(f"{final}: {cause}")
        ) from None
    _fsync_directory(directory)


def _os_error(err: BaseException) -> OSError | None:
    """The filesystem's error behind ``err`` (itself, or what it was raised while handling); ``None`` if none."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _keep_mode(final: str, temporary: str) -> None:
    """Give the new file the permissions of the one it replaces (a user's ``chmod 640`` survives a save)."""
    with contextlib.suppress(OSError):  # no previous file, or one we may not chmod like: the new file keeps its mode
        os.chmod(temporary, stat.S_IMODE(os.stat(final).st_mode))


def _fsync_directory(directory: str) -> None:
    """Make a rename in ``directory`` durable; silently not where directories cannot be opened or synced."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # Windows, or a filesystem that does not open directories
        return
    try:
        os.fsync(fd)
    except OSError:  # EINVAL on some network filesystems: the rename is as durable as that filesystem makes it
        pass
    finally:
        os.close(fd)


__all__ = ["temporary_name", "write_atomically"]
