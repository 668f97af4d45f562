"""``python -m stare_lightning ...`` for the tests, in processes forked from one that has imported the stack already.

A fresh interpreter spends about 5 s of CPU importing torch, transformers and Lightning before a command does any
work of its own, and the suite starts well over a hundred commands. Here one server per test process (started at
its first command) imports them once, and each command is a fork of it: a process of its own, with its own pid,
environment, working directory and output pipe, that runs ``python -m stare_lightning``'s module as a fresh
interpreter would and exits with its status, atexit handlers and thread joins included. What a fork does not do
again is the imports (vLLM's included): a test of what a command imports, or of how a fresh interpreter starts, asks
``run_cli`` for ``fresh=True``. ``STARE_LIGHTNING_TEST_FORK=0`` runs every command fresh. A forked command's DDP or
FSDP fit forks its further ranks from the server as well.

``ForkedCommand`` answers as much of ``subprocess.Popen`` as the tests use: ``pid``, ``stdout`` (text: the
command's stdout, with its stderr unless ``separate_stderr``), ``stderr``, ``poll``, ``wait``, ``communicate``,
``send_signal``, ``terminate``, ``kill`` and ``returncode`` (``-N`` for a command ended by signal ``N``); ``run``
stands in for ``subprocess.run(..., capture_output=True, text=True)``.

Run as a script (``python tests/forked_cli.py SOCKET``) this module is the server.
"""

from __future__ import annotations

import atexit
import gc
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
# "0": the server leaves vLLM out (the session runs no end-to-end test, so no command samples with it; conftest.py).
VLLM_ENV = "STARE_LIGHTNING_TEST_FORK_VLLM"
_MAX_REQUEST = 1 << 22


def forking(args: list[str] = ()) -> bool:
    """Whether the command ``args`` runs forked: unless ``STARE_LIGHTNING_TEST_FORK=0``, or ``verbose=true`` (whose
    vLLM configures its own logging as it is imported, while the server imported it with the project's)."""
    return os.environ.get(FORK_ENV, "1") != "0" and "verbose=true" not in args


class ForkedCommand:
    """One command forked from this process's server: ``args`` after ``python -m stare_lightning``."""

    def __init__(
        self,
        args: list[str],
        *,
        env: dict[str, str],
        cwd: str | os.PathLike,
        new_session: bool = False,
        separate_stderr: bool = False,
        inherit_output: bool = False,
    ) -> None:
        self.args = [sys.executable, "-m", "stare_lightning", *args]
        # Its stdout's pipe, then its stderr's (else stdout's); or this process's own two (``inherit_output``).
        pipes = [] if inherit_output else [os.pipe() for _ in range(2 if separate_stderr else 1)]
        request = json.dumps({"args": list(args), "env": env, "cwd": str(cwd), "new_session": new_session}).encode()
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._conn.connect(_SERVER_PATH or _server().path)
            outputs = [1, 2] if inherit_output else [w for _, w in pipes]
            socket.send_fds(self._conn, [len(request).to_bytes(4, "little") + request], outputs)
        finally:
            for _, write_end in pipes:
                os.close(write_end)
        # The caller reads them.
        streams = [open(r, encoding="utf-8", errors="replace") for r, _ in pipes]  # noqa: SIM115
        self.stdout = streams[0] if streams else None
        self.stderr = streams[1] if separate_stderr else None
        self._answers = b""  # the server's lines: the command's pid, then its exit status
        self.pid = int(self._answer(timeout=None))
        self.returncode: int | None = None
        self._readers: list[threading.Thread] = []
        self._output: dict[int, str] = {}

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

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        """The rest of the command's output (and of its stderr, if separate) once it closed them, then its status
        (``TimeoutExpired`` past ``timeout``; calling again after a kill returns the output)."""
        streams = [self.stdout, self.stderr] if self.stderr is not None else [self.stdout]
        if not self._readers:
            for i, stream in enumerate(streams):
                self._readers.append(threading.Thread(target=self._read_out, args=(i, stream), daemon=True))
                self._readers[-1].start()
        for reader in self._readers:
            reader.join(timeout)
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(timeout)
        for stream in streams:
            stream.close()
        return self._output[0], self._output.get(1)

    def _read_out(self, index: int, stream) -> None:
        self._output[index] = stream.read()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def run(args: list[str], *, cwd: str | os.PathLike, env: dict[str, str] | None = None, timeout: float | None = None):
    """``subprocess.run([python, "-m", "stare_lightning", *args], capture_output=True, text=True)``, forked (or
    fresh with ``STARE_LIGHTNING_TEST_FORK=0``)."""
    env = dict(os.environ if env is None else env)
    if not forking(args):
        command = [sys.executable, "-m", "stare_lightning", *args]
        return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    command = ForkedCommand(args, env=env, cwd=cwd, separate_stderr=True)
    try:
        out, err = command.communicate(timeout)
    except subprocess.TimeoutExpired:
        command.kill()
        command.communicate()
        raise
    return subprocess.CompletedProcess(command.args, command.returncode, out, err)


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
_SERVER_PATH: str | None = None  # in the server and the commands it forks: its socket


def _server() -> _Server:
    global _SERVER
    with _SERVER_LOCK:
        if _SERVER is None:
            _SERVER = _Server()
            atexit.register(_SERVER.stop)
        return _SERVER


# ------------------------------------------------------------------------------------------------ the server
def _serve(path: str) -> tuple[dict, list[int]]:
    """Accept commands for ever; returns only in a forked child, with its request and output descriptors."""
    global _SERVER_PATH
    _SERVER_PATH = path
    import stare_lightning.cli  # noqa: F401 - what every command imports, once
    import stare_lightning.run_config  # noqa: F401
    import stare_lightning.train  # noqa: F401

    if os.environ.get(VLLM_ENV) != "0":
        _import_vllm()

    # Frozen before any fork, as Python's gc.freeze documents: a fork's full collections then neither scan the
    # imports' objects again nor copy the pages holding them (a run freezes its setup: stare_lightning/collector.py).
    gc.collect()
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        request, outputs = _receive(conn)
        pid = os.fork()
        if pid == 0:
            listener.close()
            conn.close()
            return request, outputs
        for fd in outputs:
            os.close(fd)
        conn.sendall(f"{pid}\n".encode())
        threading.Thread(target=_report_exit, args=(conn, pid), daemon=True).start()


def _import_vllm() -> None:
    """vLLM too, where it is installed: a command that samples with it imports it (about 4 s of CPU). As a command
    imports it: in-process, its logging left to the project's (stare_lightning/console.py sets this before vLLM is
    imported, unless verbose=true: such a command runs fresh, ``forking``)."""
    configure = os.environ.get("VLLM_CONFIGURE_LOGGING")
    os.environ["VLLM_CONFIGURE_LOGGING"] = "0"
    try:
        from stare_lightning.rollout.vllm import vllm_import_error

        vllm_import_error()  # imports vllm.LLM, or says why it cannot
    finally:
        if configure is None:
            os.environ.pop("VLLM_CONFIGURE_LOGGING")
        else:
            os.environ["VLLM_CONFIGURE_LOGGING"] = configure


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, _MAX_REQUEST, 2)
    size = int.from_bytes(data[:4], "little")
    data = data[4:]
    while len(data) < size:
        data += conn.recv(size - len(data))
    return json.loads(data), fds


def _report_exit(conn: socket.socket, pid: int) -> None:
    _, status = os.waitpid(pid, 0)
    try:
        conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
    except OSError:
        pass  # the test went away
    conn.close()


def _run_command(request: dict, outputs: list[int]) -> None:
    """In the forked child: become the command, then exit through the interpreter as a fresh one would."""
    import runpy

    import torch

    if request["new_session"]:
        os.setsid()
    os.dup2(outputs[0], 1)
    os.dup2(outputs[-1], 2)
    for fd in outputs:
        os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for sig in (signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    atexit.register(gc.unfreeze)  # the server's freeze: thawed before the last collection, as a run's is (collector.py)
    if os.environ.get("OMP_NUM_THREADS"):  # read when torch was imported in the server: set again
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if not request["new_session"]:
        _fork_further_ranks()
    main = Path(sys.modules["stare_lightning"].__file__).with_name("__main__.py")
    sys.argv = [str(main), *request["args"]]
    sys.path[0] = request["cwd"]  # where `python -m` looks first: its working directory, not this file's
    runpy.run_module("stare_lightning", run_name="__main__", alter_sys=True)


class _RanksForked:
    """``subprocess`` as Lightning's DDP launcher sees it in a forked command: the further ranks it starts as
    ``python -m stare_lightning.__main__ ...`` are forked from the server too, writing to the command's own output."""

    def __getattr__(self, name: str):
        return getattr(subprocess, name)

    @staticmethod
    def Popen(command, *, env=None, cwd=None, **options):  # noqa: N802 - subprocess's name
        if list(command[:3]) != [sys.executable, "-m", "stare_lightning.__main__"] or options:
            return subprocess.Popen(command, env=env, cwd=cwd, **options)
        environment = dict(os.environ if env is None else env)
        return ForkedCommand(list(command[3:]), env=environment, cwd=cwd or os.getcwd(), inherit_output=True)


def _fork_further_ranks() -> None:
    """Lightning starts a DDP or FSDP fit's further ranks with ``subprocess.Popen`` (a fresh interpreter each: about 5 s
    of CPU importing before any work); in a forked command they are forked instead. Not in a command that runs in a
    session of its own: a forked rank could not join its process group, which a test may kill whole."""
    from lightning.fabric.strategies.launchers import subprocess_script as fabric_launcher
    from lightning.pytorch.strategies.launchers import subprocess_script as pytorch_launcher

    for launcher in (fabric_launcher, pytorch_launcher):
        launcher.subprocess = _RanksForked()


if __name__ == "__main__":
    _run_command(*_serve(sys.argv[1]))
