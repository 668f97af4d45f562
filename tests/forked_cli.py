"""``python -m stare_lightning ...`` for the tests, in processes forked from one that has imported the stack already.

A fresh interpreter spends about 5 s of CPU importing torch, transformers and Lightning before a command does any
work of its own, and the suite starts well over a hundred commands. Here one server per test process (started at
its first command) imports them once, and each command is a fork of it: a process of its own, with its own pid,
environment, working directory and output pipe, that runs ``python -m stare_lightning``'s module as a fresh
interpreter would and exits with its status, atexit handlers and thread joins included. What a fork does not do
again is the imports: a test of what a command imports, or of how a fresh interpreter starts, asks ``run_cli`` for
``fresh=True``. ``STARE_LIGHTNING_TEST_FORK=0`` runs every command fresh.

``ForkedCommand`` answers as much of ``subprocess.Popen`` as the tests use: ``pid``, ``stdout`` (text, the
command's stdout and stderr together), ``poll``, ``wait``, ``communicate``, ``send_signal``, ``terminate``,
``kill`` and ``returncode`` (``-N`` for a command ended by signal ``N``).

Run as a script (``python tests/forked_cli.py SOCKET``) this module is the server.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

FORK_ENV = "STARE_LIGHTNING_TEST_FORK"
_MAX_REQUEST = 1 << 22


def forking() -> bool:
    return os.environ.get(FORK_ENV, "1") != "0"


class ForkedCommand:
    """One command forked from this process's server: ``args`` after ``python -m stare_lightning``."""

    def __init__(self, args: list[str], *, env: dict[str, str], cwd: str | os.PathLike, new_session: bool) -> None:
        self.args = [sys.executable, "-m", "stare_lightning", *args]
        read_end, write_end = os.pipe()
        request = json.dumps({"args": list(args), "env": env, "cwd": str(cwd), "new_session": new_session}).encode()
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._conn.connect(_server().path)
            socket.send_fds(self._conn, [len(request).to_bytes(4, "little") + request], [write_end])
        finally:
            os.close(write_end)
        self.stdout = open(read_end, encoding="utf-8", errors="replace")  # noqa: SIM115 - the caller reads it
        self._answers = b""  # the server's lines: the command's pid, then its exit status
        self.pid = int(self._answer(timeout=None))
        self.returncode: int | None = None
        self._reader: threading.Thread | None = None
        self._output: list[str] = []

    def _answer(self, timeout: float | None) -> str | None:
        """The server's next line, or None if none came within ``timeout`` seconds."""
        while b"\n" not in self._answers:
            if not select.select([self._conn], [], [], timeout)[0]:
                return None
            chunk = self._conn.recv(64)
            if not chunk:
                raise RuntimeError("the forked-command server went away before it answered")
            self._answers += chunk
        line, self._answers = self._answers.split(b"\n", 1)
        return line.decode()

    def poll(self) -> int | None:
        return self._status(timeout=0)

    def wait(self, timeout: float | None = None) -> int:
        status = self._status(timeout)
        if status is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return status

    def _status(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            line = self._answer(timeout)
            if line is not None:
                self.returncode = int(line)
                self._conn.close()
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        """The rest of the command's output once it closed it, then its status (``TimeoutExpired`` past
        ``timeout``; calling again after a kill returns the output)."""
        if self._reader is None:
            self._reader = threading.Thread(target=lambda: self._output.append(self.stdout.read()), daemon=True)
            self._reader.start()
        self._reader.join(timeout)
        if self._reader.is_alive():
            raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(timeout)
        self.stdout.close()
        return "".join(self._output), None

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Server:
    def __init__(self) -> None:
        self._directory = tempfile.mkdtemp(prefix="stare-forked-cli-")
        self.path = os.path.join(self._directory, "server.sock")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # every command's streams unbuffered, as the tests start them
        self._process = subprocess.Popen(
            [sys.executable, __file__, self.path], env=env, stdout=subprocess.PIPE, text=True, cwd=self._directory
        )
        ready = self._process.stdout.readline()  # type: ignore[union-attr]
        if ready.strip() != "ready":
            raise RuntimeError(f"the forked-command server did not start (it said {ready!r})")

    def stop(self) -> None:
        self._process.kill()
        self._process.wait()
        for name in os.listdir(self._directory):
            os.unlink(os.path.join(self._directory, name))
        os.rmdir(self._directory)


_SERVER: _Server | None = None
_SERVER_LOCK = threading.Lock()


def _server() -> _Server:
    global _SERVER
    with _SERVER_LOCK:
        if _SERVER is None:
            _SERVER = _Server()
            atexit.register(_SERVER.stop)
        return _SERVER


# ------------------------------------------------------------------------------------------------ the server
def _serve(path: str) -> tuple[dict, int]:
    """Accept commands for ever; returns only in a forked child, with its request and output descriptor."""
    import stare_lightning.cli  # noqa: F401 - what every command imports, once
    import stare_lightning.run_config  # noqa: F401
    import stare_lightning.train  # noqa: F401

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        request, out = _receive(conn)
        pid = os.fork()
        if pid == 0:
            listener.close()
            conn.close()
            return request, out
        os.close(out)
        conn.sendall(f"{pid}\n".encode())
        threading.Thread(target=_report_exit, args=(conn, pid), daemon=True).start()


def _receive(conn: socket.socket) -> tuple[dict, int]:
    data, fds, _, _ = socket.recv_fds(conn, _MAX_REQUEST, 1)
    size = int.from_bytes(data[:4], "little")
    data = data[4:]
    while len(data) < size:
        data += conn.recv(size - len(data))
    return json.loads(data), fds[0]


def _report_exit(conn: socket.socket, pid: int) -> None:
    _, status = os.waitpid(pid, 0)
    try:
        conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
    except OSError:
        pass  # the test went away
    conn.close()


def _run_command(request: dict, out: int) -> None:
    """In the forked child: become the command, then exit through the interpreter as a fresh one would."""
    import runpy

    import torch

    if request["new_session"]:
        os.setsid()
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for sig in (signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if os.environ.get("OMP_NUM_THREADS"):  # read when torch was imported in the server: set again
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    main = Path(sys.modules["stare_lightning"].__file__).with_name("__main__.py")
    sys.argv = [str(main), *request["args"]]
    sys.path[0] = request["cwd"]  # where `python -m` looks first: its working directory, not this file's
    runpy.run_module("stare_lightning", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    _run_command(*_serve(sys.argv[1]))
