"""Child Python processes for the tests, forked from one warm interpreter instead of started cold.

A test that runs ``python script.py`` pays ~4.5 s of CPU before the script's first line: importing torch, Lightning
(which imports torch._dynamo and torchmetrics, matplotlib included) and this package. About thirty of the suite's
child processes do nothing before that import that would change it, so one server process (``warm_server.py``) imports
it all once, then forks a child per request and runs the script there (``runpy.run_path`` as ``__main__``; a module
``runpy.run_module`` as ``python -m`` does), as ``python script.py`` would: its own argv, environment, working
directory, ``sys.path[0]`` (the script's directory; for ``-m`` the working directory), standard streams (files),
optionally its own session (``start_new_session``), unbuffered streams for ``-u``, fresh entropy for ``random`` and
NumPy, the thread count ``OMP_NUM_THREADS`` asks for, and the interpreter's exit: its non-daemon threads waited for,
its ``atexit`` handlers run, its standard streams flushed; what the modules' teardown would finalize besides is not
(a file left open and unflushed loses its buffer, as after ``os._exit``: the tests check what the scripts write).

With ``nested=True`` the child's own ``python script.py`` children (an example's resume phase, a torchrun agent's
workers) are forked warm too (how, and which are not: ``warm_server.py``).

What a fork cannot give a child, a cold interpreter does: :func:`start` falls back to ``subprocess.Popen`` when the
environment differs from the server's in anything an interpreter or torch reads while starting (``PYTHON*``,
``TORCH*``, ``LD_*``, ...). The children share the server's string-hash seed: the tests whose claim is about separate
interpreters (the popen and spawn launchers, the console script) start cold ones themselves.
"""

from __future__ import annotations

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

from tests.helpers.warm_server import parse_command, startup_env

SERVER = Path(__file__).with_name("warm_server.py")


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
            left = timeout
            if timeout != 0.0 and hasattr(os, "pidfd_open"):  # wait for the end here: the server is not held meanwhile
                try:
                    fd = os.pidfd_open(self.pid)
                except ProcessLookupError:
                    pass  # ended, and the server has seen it
                else:
                    try:
                        if not select.select([fd], [], [], timeout)[0]:
                            left = 0.0  # still running: the server only says so
                    finally:
                        os.close(fd)
            self.returncode = self._server.wait(self.pid, left)
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

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Server:
    def __init__(self) -> None:
        self.env = dict(os.environ)
        self.proc = subprocess.Popen([sys.executable, str(SERVER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
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

    def start(self, request: dict[str, Any], merge: bool) -> Child:
        with self.lock:
            self.count += 1
            out = self.files / f"{self.count}.out"
            err = None if merge else self.files / f"{self.count}.err"
            request = {**request, "op": "start", "out": str(out), "err": str(err) if err else None}
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
          merge_stderr: bool = False, nested: bool = False) -> Process:  # fmt: skip
    """``subprocess.Popen(command, stdout=PIPE, stderr=PIPE or STDOUT, text=True, env=env, cwd=cwd,
    start_new_session=session)`` for ``command = [sys.executable, (-u), script | -m module, *args]``, forked warm where
    it can be; with ``nested``, so are the child's own children of that form."""
    parsed = parse_command(command)
    assert parsed is not None, command
    prestart()
    assert _SERVER is not None
    if startup_env(env) != startup_env(_SERVER.env) or not _SERVER.usable():
        stderr = subprocess.STDOUT if merge_stderr else subprocess.PIPE
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env,
                                cwd=cwd, start_new_session=session)  # fmt: skip
    directory = str(cwd or os.getcwd())
    if "script" in parsed:
        parsed["script"] = str(Path(directory, parsed["script"]))
    request = {**parsed, "env": env, "cwd": directory, "session": session, "nested": nested}
    return _SERVER.start(request, merge_stderr)
