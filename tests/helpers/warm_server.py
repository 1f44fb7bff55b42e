"""The warm interpreter itself (``tests/helpers/warm.py`` starts it and asks it for children): run as a script.

It imports torch, Lightning and the package once, then forks a child per request and runs the request's script or
module there as ``python script.py`` / ``python -m module`` would (what a child takes on: ``warm.py``'s docstring).
Requests come from two sides:

- the test process, one JSON line at a time on standard input, answered on standard output (``start``; ``wait``,
  answered when the child has ended or the wait's timeout has passed, while the server goes on serving);
- a child started with ``nested=True`` (and that child's own children): its ``subprocess.Popen`` of
  ``python [-u] script.py ...`` or ``python [-u] -m module ...`` asks the server, over a Unix socket, to fork that
  child too, handing over its standard streams (file descriptors passed with the request). The server tells it the
  child's wait status when it ends, which is how its ``Popen`` object learns the exit code. Such a child's parent is
  the server, not the process that asked for it: a script that checks its parent (the package's popen launcher's
  ranks do, through ``LDET_LAUNCHER_PID``) or asks for anything ``fork`` cannot give (``preexec_fn``, another user,
  another environment at start) is started as ``Popen`` would, cold.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from typing import Any

# What a cold start reads from the environment before any script line runs: a request that differs here gets one.
STARTUP_PREFIXES = ("PYTHON", "TORCH", "LD_", "MKL_", "KMP_", "GOMP_", "OMP_PROC_BIND", "OMP_WAIT_POLICY", "CUDA_")
# ... but not these, read when used, not at start: torchrun sets the first two for its workers (read when a process
# group starts); torch sets TORCHINDUCTOR_CACHE_DIR to its default the first time it needs Inductor's cache (and reads
# it each time), and torch 2.8 sets CUDA_MODULE_LOADING=LAZY when Inductor first looks for CUDA (read when CUDA starts).
RUNTIME_PREFIXES = ("TORCHELASTIC_", "TORCH_NCCL_", "TORCHINDUCTOR_CACHE_DIR", "CUDA_MODULE_LOADING")
PRELOAD = ("numpy", "torch", "torch.distributed", "lightning", "lightning.pytorch", "torchmetrics",
           "lightning_determinism")  # fmt: skip
# A child that must be the requester's own child: the package's popen launcher's ranks check their parent's pid.
OWN_CHILD_KEYS = ("LDET_LAUNCHER_PID",)


def startup_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(STARTUP_PREFIXES) and not k.startswith(RUNTIME_PREFIXES)}


def parse_command(command: list[str]) -> dict[str, Any] | None:
    """``[sys.executable, (-u), script | -m module, *args]`` as a request's fields; ``None`` for any other command."""
    if len(command) < 2 or command[0] != sys.executable:
        return None
    rest, unbuffered = list(command[1:]), False
    while rest and rest[0] == "-u":
        unbuffered = True
        rest.pop(0)
    if len(rest) >= 2 and rest[0] == "-m":
        return {"module": rest[1], "args": rest[2:], "unbuffered": unbuffered}
    if rest and not rest[0].startswith("-"):
        return {"script": rest[0], "args": rest[1:], "unbuffered": unbuffered}
    return None


def status_code(status: int) -> int:
    """A raw wait status as ``Popen.returncode`` has it."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


# --- in a child: becoming the requested process -----------------------------------------------------------------------

_NESTED_SOCKET: str | None = None  # the server's socket, in a child that may start warm children of its own


def _become(request: dict[str, Any], base_path: list[str], stdio: list[int]) -> None:
    """In the forked child: take on the request's process state (``stdio``: its standard streams' descriptors)."""
    global _NESTED_SOCKET
    if request["session"]:
        os.setsid()
    for target, fd in enumerate(stdio):
        os.dup2(fd, target)
    for fd in set(stdio) - {0, 1, 2}:
        os.close(fd)
    if request["unbuffered"]:  # `python -u`: the text streams write through to unbuffered files
        for name in ("stdout", "stderr"):
            old = getattr(sys, name)
            raw = io.FileIO(old.fileno(), "w", closefd=False)
            setattr(sys, name, io.TextIOWrapper(raw, encoding=old.encoding, errors=old.errors, write_through=True))
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    if "script" in request:
        sys.argv = [request["script"], *request["args"]]
        sys.path[:] = [os.path.dirname(os.path.realpath(request["script"])), *base_path]
    else:
        sys.argv = [request["module"], *request["args"]]  # runpy puts the module's file in argv[0]
        sys.path[:] = [os.getcwd(), *base_path]
    if request.get("nested"):
        _NESTED_SOCKET = request["socket"]
        _nest()
    import random

    import numpy as np
    import torch

    random.seed()  # a cold interpreter's entropy, not the server's state shared by every child
    np.random.seed()
    if request["env"].get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(request["env"]["OMP_NUM_THREADS"]))  # read at start by a cold interpreter


def _run(request: dict[str, Any]) -> int:
    import runpy
    import traceback

    try:
        if "script" in request:
            runpy.run_path(request["script"], run_name="__main__")
        else:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            return exit_.code or 0
        print(exit_.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001  (what a cold interpreter prints, and its exit code)
        traceback.print_exc()
        return 1
    return 0


def _exit(code: int) -> None:
    """End as the interpreter does (wait for the script's threads, run its ``atexit`` handlers, flush the standard
    streams), without tearing the modules down: in a fork that touches every page the server shares (~1 s)."""
    import atexit
    import threading

    threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's first step at exit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


# --- in a child with nested=True: its Popen asks the server -----------------------------------------------------------


def _send(sock: socket.socket, message: dict[str, Any], fds: list[int] = ()) -> None:  # type: ignore[assignment]
    payload = json.dumps(message).encode()
    socket.send_fds(sock, [struct.pack("!I", len(payload)) + payload], list(fds))


def _receive(sock: socket.socket, max_fds: int = 0) -> tuple[dict[str, Any], list[int]]:
    data, fds, _, _ = socket.recv_fds(sock, 1 << 16, max_fds) if max_fds else (sock.recv(1 << 16), [], 0, None)
    while len(data) < 4 or len(data) < 4 + struct.unpack("!I", data[:4])[0]:
        more = sock.recv(1 << 16)
        if not more:
            raise ConnectionError("the warm interpreter closed the connection mid-message")
        data += more
    return json.loads(data[4:]), fds


class NestedPopen(subprocess.Popen):
    """``subprocess.Popen`` whose ``python script.py`` children the warm server forks (see the module's docstring)."""

    _warm: socket.socket | None = None  # where the server tells this child's wait status

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo, creationflags,
                       shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, *rest):  # fmt: skip
        # rest: restore_signals, gid, gids, uid, umask, start_new_session[, process_group (3.11+)]
        plain = not (shell or executable or preexec_fn or pass_fds) and close_fds and isinstance(args, (list, tuple))
        plain = plain and rest[1:4] == (None, None, None) and rest[4] == -1 and (len(rest) < 7 or rest[6] in (None, -1))
        parsed = parse_command([os.fsdecode(arg) for arg in args]) if plain else None
        environ = dict(os.environ) if env is None else {os.fsdecode(k): os.fsdecode(v) for k, v in env.items()}
        if parsed is not None and _NESTED_SOCKET is not None and not any(key in environ for key in OWN_CHILD_KEYS):
            request = {**parsed, "env": environ, "cwd": os.fsdecode(cwd) if cwd else os.getcwd(),
                       "session": bool(rest[5])}  # fmt: skip
            if "script" in request:
                request["script"] = os.path.join(request["cwd"], request["script"])
            stdio = [fd if fd != -1 else std for fd, std in ((p2cread, 0), (c2pwrite, 1), (errwrite, 2))]
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(_NESTED_SOCKET)
            _send(sock, request, stdio)
            answer, _ = _receive(sock)
            if "pid" in answer:
                self.pid, self._child_created, self._warm = answer["pid"], True, sock
                self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
                return
            sock.close()  # refused: started cold, as Popen does
        super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo, creationflags,
                               shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, *rest)  # fmt: skip

    def _try_wait(self, wait_flags: int) -> tuple[int, int]:
        if self._warm is None:
            return super()._try_wait(wait_flags)
        self._warm.setblocking(not wait_flags & os.WNOHANG)
        try:
            line = self._warm.recv(64)
        except BlockingIOError:
            return 0, 0
        self._warm.close()
        self._warm = None
        return self.pid, int(line) if line.strip() else signal.SIGKILL  # the server ended: as if killed

    def _internal_poll(self, _deadstate: int | None = None, **_: Any) -> int | None:
        if self._warm is None:
            return super()._internal_poll(_deadstate)
        if self.returncode is None and self._waitpid_lock.acquire(False):
            try:
                pid, status = self._try_wait(os.WNOHANG)
                if pid == self.pid:
                    self._handle_exitstatus(status)
            finally:
                self._waitpid_lock.release()
        return self.returncode


def _nest() -> None:
    """Have this child's ``Popen`` (``subprocess``'s, and the modules' that imported the name) ask the server."""
    original = subprocess.Popen
    for module in list(sys.modules.values()):
        if getattr(module, "Popen", None) is original:
            module.Popen = NestedPopen  # type: ignore[attr-defined]


# --- the server ------------------------------------------------------------------------------------------------------


class _Server:
    def __init__(self, base_path: list[str], reply: io.TextIOBase, env: dict[str, str]) -> None:
        self.base_path, self.reply, self.env = base_path, reply, env  # env: as the server started, before its imports
        self.done: dict[int, int] = {}  # pid -> returncode, for the children that ended
        self.started: dict[int, bool] = {}  # pid -> in a session of its own (ended with its group at the end)
        self.watchers: dict[int, socket.socket] = {}  # pid -> the nested request's connection
        self.wake_r, wake_w = os.pipe()
        for fd in (self.wake_r, wake_w):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that SIGCHLD wakes select() up
        self.socket_dir = tempfile.mkdtemp(prefix="warm-socket-")
        self.socket_path = os.path.join(self.socket_dir, "nested")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.socket_path)
        self.listener.listen(64)
        self.wake_w = wake_w

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.done[pid] = status_code(status)
            watcher = self.watchers.pop(pid, None)
            if watcher is not None:
                try:
                    watcher.sendall(f"{status}\n".encode())
                except OSError:
                    pass  # the process that asked for it has gone
                watcher.close()

    def _fork(self, request: dict[str, Any], stdio: list[int], keep: socket.socket | None = None) -> int:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self._forget(keep)
            _become({**request, "socket": self.socket_path}, self.base_path, stdio)
            return 0
        self.started[pid] = request["session"]
        return pid

    def _forget(self, keep: socket.socket | None) -> None:
        """In a forked child: close what is the server's (through their objects, which would close them again)."""
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.close(self.wake_r)
        os.close(self.wake_w)
        for sock in [self.listener, *self.watchers.values(), *([keep] if keep is not None else [])]:
            sock.close()
        self.watchers.clear()
        self.reply.close()

    def _start(self, request: dict[str, Any]) -> int:
        """A request of the test process: standard streams to files."""
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        err = os.open(request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if request["err"] else out
        pid = self._fork(request, [null, out, err])
        if pid:
            for fd in {null, out, err}:
                os.close(fd)
        return pid

    def _accept(self) -> dict[str, Any] | None:
        """A nested request: fork it (returns the request in the child) or refuse it."""
        conn, _ = self.listener.accept()
        try:
            request, stdio = _receive(conn, max_fds=3)
        except (OSError, ValueError):
            conn.close()
            return None
        if startup_env(request["env"]) != startup_env(self.env):  # the requester's Popen then starts it cold
            for fd in stdio:
                os.close(fd)
            _send(conn, {"refused": "another environment at start"})
            conn.close()
            return None
        pid = self._fork({**request, "nested": True}, stdio, keep=conn)
        if pid == 0:
            return request
        for fd in stdio:
            os.close(fd)
        _send(conn, {"pid": pid})
        self.watchers[pid] = conn
        return None

    def serve(self) -> dict[str, Any] | None:
        """Answer requests until standard input ends; in a forked child, return its request instead."""
        buffer, stdin_open = b"", True
        pending: tuple[int, float | None] | None = None  # a `wait` answered once its pid ended or its time is up
        self.reply.write("ready\n")
        while stdin_open:
            self._reap()
            if pending is not None and (pending[0] in self.done or (pending[1] or float("inf")) <= time.monotonic()):
                self.reply.write(json.dumps({"returncode": self.done.get(pending[0])}) + "\n")
                pending = None
            while pending is None and b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                request = json.loads(line)
                if request["op"] == "start":
                    pid = self._start(request)
                    if pid == 0:
                        return request
                    self.reply.write(json.dumps({"pid": pid}) + "\n")
                elif request["pid"] in self.done or request["timeout"] == 0:
                    self.reply.write(json.dumps({"returncode": self.done.get(request["pid"])}) + "\n")
                else:
                    deadline = None if request["timeout"] is None else time.monotonic() + request["timeout"]
                    pending = (request["pid"], deadline)
            timeout = None if pending is None or pending[1] is None else max(0.0, pending[1] - time.monotonic())
            watched = [self.wake_r, self.listener] + ([0] if pending is None else [])
            readable = select.select(watched, [], [], timeout)[0]
            if self.wake_r in readable:  # SIGCHLD woke it up: empty the pipe (reaped at the loop's top)
                with contextlib.suppress(BlockingIOError):
                    while os.read(self.wake_r, 512):
                        pass
            if self.listener in readable:
                nested = self._accept()
                if nested is not None:
                    return nested
            if 0 in readable:
                data = os.read(0, 1 << 16)
                buffer += data
                stdin_open = bool(data)
        self._end()
        return None

    def _end(self) -> None:
        """The tests are over: nothing they started outlives them."""
        for pid, session in self.started.items():
            if pid not in self.done:
                try:
                    os.killpg(pid, signal.SIGKILL) if session else os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 5.0
        while any(pid not in self.done for pid in self.started) and time.monotonic() < deadline:
            self._reap()
            select.select([self.wake_r], [], [], 0.1)
        self.listener.close()
        os.unlink(self.socket_path)
        os.rmdir(self.socket_dir)


def main() -> None:
    import importlib

    env = dict(os.environ)  # torch's import sets variables (TORCHINDUCTOR_CACHE_DIR) that a cold start has not yet
    sys.path.pop(0)  # this file's directory: a cold `python script.py` has the script's own there instead
    for name in PRELOAD:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()  # a child's garbage collections then skip (and do not copy) the imported modules' objects
    replies = os.dup(1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # nothing but replies on the reply channel
    reply = os.fdopen(replies, "w", buffering=1)
    request = _Server(list(sys.path), reply, env).serve()
    if request is not None:
        _exit(_run(request))


if __name__ == "__main__":
    main()
