"""Child Python processes for the tests, forked from one warm interpreter instead of started cold.

A test that runs ``python script.py`` pays ~4.5 s of CPU before the script's first line: importing torch, Lightning
(which imports torch._dynamo and torchmetrics, matplotlib included) and this package. About twenty-five of the
suite's child processes do nothing before that import that would change it, so one server process imports it all
once, then forks a child per request and runs the script there (``runpy.run_path`` as ``__main__``), as
``python script.py`` would: its own argv, environment, working directory, ``sys.path[0]`` (the script's directory),
standard streams (files), optionally its own session (``start_new_session``), fresh entropy for ``random`` and
NumPy, the thread count ``OMP_NUM_THREADS`` asks for, and the interpreter's exit: its non-daemon threads waited for,
its ``atexit`` handlers run, its standard streams flushed; what the modules' teardown would finalize besides is not
(a file left open and unflushed loses its buffer, as after ``os._exit``: the tests check what the scripts write).

What a fork cannot give a child, a cold interpreter does: :func:`start` falls back to ``subprocess.Popen`` when the
environment differs from the server's in anything an interpreter or torch reads while starting (``PYTHON*``,
``TORCH*``, ``LD_*``, ...). The children share the server's string-hash seed: the tests whose claim is about separate
interpreters (the hash seed, the popen and spawn launchers, torchrun, the console script) start cold ones themselves.

The server is this file run as a script; it answers one JSON line per request on its standard output.
"""

from __future__ import annotations

import gc
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

# What a cold start reads from the environment before any script line runs: a request that differs here gets one.
_STARTUP_PREFIXES = ("PYTHON", "TORCH", "LD_", "MKL_", "KMP_", "GOMP_", "OMP_PROC_BIND", "OMP_WAIT_POLICY", "CUDA_")
_PRELOAD = ("numpy", "torch", "torch.distributed", "lightning", "lightning.pytorch", "torchmetrics",
            "lightning_determinism")  # fmt: skip


def _startup_env(env: dict[str, str]) -> dict[str, str]:
    return {key: value for key, value in env.items() if key.startswith(_STARTUP_PREFIXES)}


class Child:
    """A forked child as the tests use a ``subprocess.Popen``: ``pid``, ``poll``, ``wait``, ``communicate``."""

    def __init__(self, server: _Server, pid: int, out: Path, err: Path | None) -> None:
        self._server, self.pid, self._out, self._err = server, pid, out, err
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.wait(self.pid, 0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._server.wait(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(f"warm child {self.pid}", timeout or 0.0)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        self.wait(timeout)
        err = self._err.read_text(errors="replace") if self._err is not None else None
        return self._out.read_text(errors="replace"), err

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Server:
    def __init__(self) -> None:
        self.env = dict(os.environ)
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=self.env, cwd=os.getcwd())  # fmt: skip
        self.lock = threading.Lock()
        self.ready: bool | None = None
        self.files = Path(tempfile.mkdtemp(prefix="warm-children-"))
        self.count = 0

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the warm interpreter ended (exit code {self.proc.wait()})")
        return json.loads(line)

    def usable(self) -> bool:
        with self.lock:
            if self.ready is None:
                assert self.proc.stdout is not None
                self.ready = self.proc.stdout.readline().strip() == "ready"
            return self.ready

    def start(self, argv: list[str], env: dict[str, str], cwd: str | None, session: bool, merge: bool) -> Child:
        with self.lock:
            self.count += 1
            out = self.files / f"{self.count}.out"
            err = None if merge else self.files / f"{self.count}.err"
            request = {"op": "start", "argv": argv, "env": env, "cwd": cwd or os.getcwd(), "session": session,
                       "out": str(out), "err": str(err) if err else None}  # fmt: skip
            return Child(self, self._ask(request)["pid"], out, err)

    def wait(self, pid: int, timeout: float | None) -> int | None:
        with self.lock:
            return self._ask({"op": "wait", "pid": pid, "timeout": timeout})["returncode"]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()  # the server kills the children left, then exits
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        if self.proc.stdout is not None:
            self.proc.stdout.close()  # else an unclosed-file ResourceWarning at exit, after pytest's summary line
        shutil.rmtree(self.files, ignore_errors=True)


Process = Child | subprocess.Popen
_SERVER: _Server | None = None


def prestart() -> None:
    """Start the server now (its imports take a core for ~4.5 s), so that the first child does not wait for them."""
    global _SERVER
    if _SERVER is None:
        _SERVER = _Server()
        import atexit

        atexit.register(_SERVER.close)


def start(command: list[str], *, env: dict[str, str], cwd: str | Path | None = None, session: bool = False,
          merge_stderr: bool = False) -> Process:  # fmt: skip
    """``subprocess.Popen(command, stdout=PIPE, stderr=PIPE or STDOUT, text=True, env=env, cwd=cwd,
    start_new_session=session)`` for ``command = [sys.executable, script, *args]``, forked warm where it can be."""
    assert command[0] == sys.executable and not command[1].startswith("-"), command
    prestart()
    assert _SERVER is not None
    if _startup_env(env) != _startup_env(_SERVER.env) or not _SERVER.usable():
        stderr = subprocess.STDOUT if merge_stderr else subprocess.PIPE
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env,
                                cwd=cwd, start_new_session=session)  # fmt: skip
    script = str(Path(cwd or os.getcwd(), command[1]))
    return _SERVER.start([script, *command[2:]], env, str(cwd) if cwd else None, session, merge_stderr)


# --- the server side -------------------------------------------------------------------------------------------------


def _status(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _wait(pid: int, timeout: float | None, done: dict[int, int]) -> int | None:
    if pid in done:
        return done[pid]
    reaped, status = os.waitpid(pid, os.WNOHANG)
    if reaped == 0 and timeout != 0.0:
        if hasattr(os, "pidfd_open"):
            fd = os.pidfd_open(pid)
            try:
                select.select([fd], [], [], timeout)  # readable once the child has ended
            finally:
                os.close(fd)
            reaped, status = os.waitpid(pid, os.WNOHANG)
        elif timeout is None:
            reaped, status = os.waitpid(pid, 0)
        else:
            import time

            deadline = time.monotonic() + timeout
            while reaped == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
                reaped, status = os.waitpid(pid, os.WNOHANG)
    if reaped == 0:
        return None
    done[pid] = _status(status)
    return done[pid]


def _become(request: dict[str, Any], base_path: list[str]) -> str:
    """In the forked child: take on the request's process state; return the script to run."""
    if request["session"]:
        os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = os.open(request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if request["err"] else out
    os.dup2(out, 1)
    os.dup2(err, 2)
    for fd in {null, out, err}:
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    script = request["argv"][0]
    sys.argv = list(request["argv"])
    sys.path[:] = [os.path.dirname(os.path.realpath(script)), *base_path]
    import random

    import numpy as np
    import torch

    random.seed()  # a cold interpreter's entropy, not the server's state shared by every child
    np.random.seed()
    if request["env"].get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(request["env"]["OMP_NUM_THREADS"]))  # read at start by a cold interpreter
    return script


def _serve() -> str | None:
    """Answer requests until standard input ends; in a forked child, return its script instead."""
    import importlib

    sys.path.pop(0)  # this file's directory: a cold `python script.py` has the script's own there instead
    for name in _PRELOAD:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()  # a child's garbage collections then skip (and do not copy) the imported modules' objects
    base_path = list(sys.path)
    replies = os.dup(1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # nothing but replies on the reply channel
    reply = os.fdopen(replies, "w", buffering=1)
    reply.write("ready\n")
    done: dict[int, int] = {}
    started: list[tuple[int, bool]] = []
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "start":
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                reply.close()
                return _become(request, base_path)
            started.append((pid, request["session"]))
            reply.write(json.dumps({"pid": pid}) + "\n")
        else:
            reply.write(json.dumps({"returncode": _wait(request["pid"], request["timeout"], done)}) + "\n")
    for pid, session in started:  # the tests are over: nothing they started outlives them
        if pid not in done:
            try:
                os.killpg(pid, signal.SIGKILL) if session else os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _wait(pid, 5.0, done)
    return None


def _run(script: str) -> int:
    import runpy
    import traceback

    try:
        runpy.run_path(script, run_name="__main__")
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


if __name__ == "__main__":
    _script = _serve()
    if _script is not None:
        _exit(_run(_script))
