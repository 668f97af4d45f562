"""The verifier worker's seccomp filter, in a real worker: code that runs there (a verifier's ``warmup``, outside the
scoring guard, as code that found a way to run would) cannot make namespaces, trace, reach eBPF, keyrings or
io_uring, or open any socket but AF_UNIX; what a verifier needs (imports, sympy, math-verify, mmap) still works.
The probes report each outcome through the scores: 1.0 for a call that worked, errno / 1000 for one refused.
"""

from __future__ import annotations

import errno
import sys

import pytest

from stare_lightning.rewards import VerifierPool
from stare_lightning.tools.libseccomp import syscall_number

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the verifier worker's confinement is Linux's")

PROBE_MODULE = """
import ctypes, mmap, os, socket

NUMBERS = {numbers!r}
RESULTS = {{}}
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


def _raw(name, *args):
    result = libc.syscall(ctypes.c_long(NUMBERS[name]), *(ctypes.c_long(arg) for arg in args))
    if result < 0:
        raise OSError(ctypes.get_errno(), name)


def _socket(family, kind=socket.SOCK_STREAM):
    socket.socket(family, kind).close()


def _pair():
    for end in socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM):
        end.close()


def _mmap():
    with mmap.mmap(-1, 1 << 20) as region:
        region[:4] = b"abcd"


def _imports():
    import math_verify  # noqa: F401
    import sympy

    assert sympy.simplify("2*x - x") == sympy.Symbol("x")


def _attempt(name, action):
    try:
        action()
        RESULTS[name] = 1.0
    except OSError as err:
        RESULTS[name] = err.errno / 1000
    except BaseException:
        RESULTS[name] = 0.0


def warmup():
    _attempt("unshare_user", lambda: _raw("unshare", 0x10000000))
    _attempt("unshare_net", lambda: _raw("unshare", 0x40000000))
    _attempt("clone_newuser", lambda: _raw("clone", 0x10000000 | 17, 0, 0, 0, 0))
    _attempt("setns", lambda: _raw("setns", 0, 0))
    _attempt("ptrace_traceme", lambda: _raw("ptrace", 0, 0, 0, 0))
    _attempt("process_vm_readv", lambda: _raw("process_vm_readv", os.getpid(), 0, 0, 0, 0, 0))
    _attempt("bpf", lambda: _raw("bpf", 0, 0, 0))
    _attempt("keyctl", lambda: _raw("keyctl", 0, -3, 1))
    _attempt("io_uring_setup", lambda: _raw("io_uring_setup", 0, 0))
    _attempt("perf_event_open", lambda: _raw("perf_event_open", 0, 0, -1, -1, 0))
    _attempt("clone3", lambda: _raw("clone3", 0, 0))
    _attempt("socket_inet", lambda: _socket(socket.AF_INET))
    _attempt("socket_inet6", lambda: _socket(socket.AF_INET6))
    _attempt("socket_netlink", lambda: _socket(socket.AF_NETLINK, socket.SOCK_DGRAM))
    _attempt("socket_vsock", lambda: _socket(40))
    _attempt("socket_unix", lambda: _socket(socket.AF_UNIX))
    _attempt("socketpair_unix", _pair)
    _attempt("mmap", _mmap)
    _attempt("imports", _imports)


def probe(response, answer, metadata):
    return RESULTS[response]


probe.warmup = warmup
"""
REFUSED = {
    "unshare_user": errno.EPERM, "unshare_net": errno.EPERM, "clone_newuser": errno.EPERM, "setns": errno.EPERM,
    "ptrace_traceme": errno.EPERM, "process_vm_readv": errno.EPERM, "bpf": errno.EPERM, "keyctl": errno.EPERM,
    "io_uring_setup": errno.EPERM, "perf_event_open": errno.EPERM, "clone3": errno.ENOSYS,
    "socket_inet": errno.EAFNOSUPPORT, "socket_inet6": errno.EAFNOSUPPORT, "socket_netlink": errno.EAFNOSUPPORT,
    "socket_vsock": errno.EAFNOSUPPORT,
}  # fmt: skip
WORKS = ("socket_unix", "socketpair_unix", "mmap", "imports")


def test_the_worker_refuses_namespaces_tracing_and_non_unix_sockets_and_still_verifies(tmp_path, monkeypatch):
    names = ("unshare", "clone", "setns", "ptrace", "process_vm_readv", "bpf", "keyctl", "io_uring_setup",
             "perf_event_open", "clone3")  # fmt: skip
    source = PROBE_MODULE.format(numbers={name: syscall_number(name) for name in names})
    (tmp_path / "seccomp_probe_verifier.py").write_text(source)
    tmp_path.chmod(0o755)  # the worker's own uid reads it
    monkeypatch.syspath_prepend(str(tmp_path))  # under /tmp/pytest-of-<user>: bound back for the worker
    attempts = [*REFUSED, *WORKS]
    with VerifierPool(timeout_s=60.0) as pool:
        result = pool.score(
            [("seccomp_probe_verifier:probe", attempt, "", {}) for attempt in attempts]
            + [("math", "The answer is \\boxed{\\frac{1}{2}}", "0.5", {})]
        )
    assert result.errors == 0, result.messages
    outcome = dict(zip(attempts, result.scores))
    refused = {name: round(outcome[name] * 1000) for name in REFUSED}
    assert refused == REFUSED, {name: (errno.errorcode.get(got, got), outcome[name]) for name, got in refused.items()}
    assert [outcome[name] for name in WORKS] == [1.0] * len(WORKS), outcome
    assert result.scores[-1] == 1.0  # math-verify scores under the filter
