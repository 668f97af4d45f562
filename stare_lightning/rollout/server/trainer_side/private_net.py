"""A network namespace of its own for a launched server that listens on a Unix socket: the engine's TCP ports out
of every other local user's reach.

vLLM's engine worker opens about a dozen TCP listeners on the loopback interface for its internal process groups
(torch's gloo transport; vLLM 0.32 offers no Unix-domain transport for them). They take no credential, and every
connection leaks a descriptor in the worker, even one closed at once: about 1,600 connect-and-close rounds by any
local user end the engine with ``accept: Too many open files``. A server that listens on a Unix socket needs no
network at all (the socket is a file, reached through the file system from every namespace; so are the ZMQ IPC
sockets between the server's own processes), so the launcher starts it in a fresh network namespace holding only
its own loopback interface: its ports exist there alone.

Root unshares the network namespace directly; any other user first enters a user namespace of its own in which it
keeps its uid and gid (``uid_map`` ``<uid> <uid> 1``), which unprivileged users may do on most kernels. Where the
kernel refuses (``user.max_user_namespaces`` = 0, an LSM rule), the server runs on the host's network and the
launcher says so in its log; either way the server may open as many descriptors as its hard limit allows, which
makes a flood take longer but does not stop it.

``enter`` runs in the child between ``fork`` and ``exec`` (``subprocess.Popen(preexec_fn=...)``): a single thread,
which a user namespace requires; libc's ``unshare`` is looked up before any fork.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import os
import resource
import socket
import struct
import subprocess
import sys

__all__ = ["available", "enter", "preexec", "raise_descriptor_limit"]

_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_PR_SET_DUMPABLE = 4
_libc = ctypes.CDLL(None, use_errno=True)
_unshare, _prctl = _libc.unshare, _libc.prctl


def raise_descriptor_limit() -> None:
    """Soft ``RLIMIT_NOFILE`` up to the hard one (in the child: the server's processes inherit it)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def enter() -> None:
    """Move this (single-threaded) process into a new network namespace with its loopback interface up; for a user
    other than root, inside a user namespace of its own with the same uid and gid."""
    uid, gid = os.geteuid(), os.getegid()
    if _unshare(_CLONE_NEWNET if uid == 0 else _CLONE_NEWUSER | _CLONE_NEWNET) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"unshare: {os.strerror(code)}")
    if uid != 0:
        # A process whose credentials changed (setuid from root, a setuid program) is not dumpable, which leaves its
        # /proc/self files root's: it could not write its own maps. It is its own user's process again here.
        _prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as out:
                out.write(text)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(sock, _SIOCGIFFLAGS, request + b"\0" * 22)[:18])[1]
        fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | _IFF_UP) + b"\0" * 22)


def _enter_and_limit() -> None:
    enter()
    raise_descriptor_limit()


@functools.cache
def available() -> str | None:
    """None when a child of this process can enter a private network namespace here, else why not (checked once,
    by starting a child that does)."""
    probe = "import socket; socket.create_server(('127.0.0.1', 0)).close()"
    try:
        done = subprocess.run(
            [sys.executable, "-c", probe], preexec_fn=_enter_and_limit, capture_output=True, text=True, timeout=60
        )
    except (subprocess.SubprocessError, OSError) as err:
        return f"a private network namespace cannot be made here ({err})"
    if done.returncode != 0:
        return f"loopback is not usable in a private network namespace: {done.stderr.strip()[-300:]}"
    return None


def preexec(private: bool, cpus: set[int] | None):
    """The launcher's ``preexec_fn``: the CPU affinity, the descriptor limit, and with ``private`` the namespace."""

    def run() -> None:
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        if private:
            enter()
        raise_descriptor_limit()

    return run
