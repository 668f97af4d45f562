"""A thin ctypes binding of libseccomp (``libseccomp.so.2``), the C library that builds seccomp filters.

Only what the rule sets of ``seccomp.py`` need: a filter with a default action, one architecture, rules by syscall
name with argument comparisons, exported as classic BPF (what ``bwrap --seccomp FD`` reads) or loaded into this
process. libseccomp resolves the names to each architecture's numbers and writes the architecture check, so no
syscall table or jump offset is written by hand here.

The library is opened by its soname (the dynamic loader's cache finds it); ``ctypes.util.find_library`` would run
``ldconfig`` in a subprocess, which a process that may not fork (the confined verifier worker) cannot do.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass

__all__ = [
    "ACT_ALLOW",
    "ACT_KILL_PROCESS",
    "Comparison",
    "Filter",
    "LibseccompMissing",
    "act_errno",
    "syscall_name",
    "syscall_number",
    "version",
]

SONAME = "libseccomp.so.2"
ACT_KILL_PROCESS = 0x80000000
ACT_ALLOW = 0x7FFF0000
_ACT_ERRNO = 0x00050000
_ATTR_ACT_BADARCH, _ATTR_CTL_TSYNC = 2, 4  # enum scmp_filter_attr
_NATIVE = 0  # SCMP_ARCH_NATIVE
_UNKNOWN_SYSCALL = -1  # __NR_SCMP_ERROR
COMPARISONS = {"!=": 1, "<": 2, "<=": 3, "==": 4, ">=": 5, ">": 6, "&==": 7}  # enum scmp_compare


class LibseccompMissing(RuntimeError):
    """libseccomp.so.2 cannot be loaded here."""


class _ArgCmp(ctypes.Structure):  # struct scmp_arg_cmp
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


class _Version(ctypes.Structure):  # struct scmp_version
    _fields_ = [("major", ctypes.c_uint), ("minor", ctypes.c_uint), ("micro", ctypes.c_uint)]


@dataclass(frozen=True)
class Comparison:
    """``args[arg] <op> value``; for ``&==``, ``args[arg] & mask == value``."""

    arg: int
    op: str
    value: int
    mask: int = 0

    def raw(self) -> _ArgCmp:
        if self.op == "&==":
            return _ArgCmp(self.arg, COMPARISONS[self.op], self.mask, self.value)
        return _ArgCmp(self.arg, COMPARISONS[self.op], self.value, 0)


def act_errno(number: int) -> int:
    """The action that fails the syscall with ``number`` (an errno) and does not run it."""
    return _ACT_ERRNO | (number & 0xFFFF)


@functools.cache
def _library() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL(SONAME, use_errno=True)
    except OSError as err:
        raise LibseccompMissing(
            f"{SONAME} cannot be loaded ({err}): the sandbox and the verifier worker build their seccomp filters "
            "with libseccomp; install it (`apt-get install libseccomp2`, `dnf install libseccomp`)"
        ) from err
    pointer, u32 = ctypes.c_void_p, ctypes.c_uint32
    signatures = {
        "seccomp_init": (pointer, [u32]),
        "seccomp_release": (None, [pointer]),
        "seccomp_attr_set": (ctypes.c_int, [pointer, ctypes.c_int, u32]),
        "seccomp_arch_resolve_name": (u32, [ctypes.c_char_p]),
        "seccomp_arch_native": (u32, []),
        "seccomp_arch_add": (ctypes.c_int, [pointer, u32]),
        "seccomp_arch_remove": (ctypes.c_int, [pointer, u32]),
        "seccomp_syscall_resolve_name": (ctypes.c_int, [ctypes.c_char_p]),
        "seccomp_syscall_resolve_num_arch": (pointer, [u32, ctypes.c_int]),
        "seccomp_rule_add_array": (ctypes.c_int, [pointer, u32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(_ArgCmp)]),
        "seccomp_export_bpf": (ctypes.c_int, [pointer, ctypes.c_int]),
        "seccomp_load": (ctypes.c_int, [pointer]),
        "seccomp_version": (ctypes.POINTER(_Version), []),
    }
    for name, (result, arguments) in signatures.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = result, arguments
    return lib


def version() -> str:
    found = _library().seccomp_version().contents
    return f"{found.major}.{found.minor}.{found.micro}"


def syscall_number(name: str) -> int:
    """This machine's number of the syscall ``name``; ValueError when libseccomp does not know it (a number below
    -1 is libseccomp's stand-in for a syscall this architecture lacks)."""
    number = _library().seccomp_syscall_resolve_name(name.encode())
    if number == _UNKNOWN_SYSCALL:
        raise ValueError(f"libseccomp {version()} knows no syscall {name!r} (2.5 or later does)")
    return number


def syscall_name(number: int, architecture: str) -> str | None:
    """The name of syscall ``number`` on ``architecture`` (libseccomp's name for it), None for an unused number."""
    lib = _library()
    token = lib.seccomp_arch_resolve_name(architecture.encode())
    if not token:
        raise ValueError(f"libseccomp {version()} knows no architecture {architecture!r}")
    found = lib.seccomp_syscall_resolve_num_arch(token, number)
    if not found:
        return None
    try:
        return ctypes.string_at(found).decode()
    finally:
        _libc_free(found)


_libc_free = ctypes.CDLL(None).free
_libc_free.argtypes, _libc_free.restype = [ctypes.c_void_p], None


def _check(result: int, what: str) -> None:
    if result < 0:  # libseccomp returns -errno
        raise OSError(-result, f"libseccomp {what}: {os.strerror(-result)}")


class Filter:
    """One filter under construction: ``with Filter(default) as f: f.add(...); f.export_bpf()``."""

    def __init__(self, default_action: int, architecture: str | None = None) -> None:
        self._lib = _library()
        self._context = self._lib.seccomp_init(default_action)
        if not self._context:
            raise OSError(0, "libseccomp seccomp_init failed")
        try:
            self._configure(architecture)
        except BaseException:
            self.close()
            raise

    def _configure(self, architecture: str | None) -> None:
        # A syscall of another ABI (i386 on x86_64, x32) ends the process: its numbers mean other calls.
        _check(self._lib.seccomp_attr_set(self._context, _ATTR_ACT_BADARCH, ACT_KILL_PROCESS), "set bad-arch action")
        if architecture is not None:
            token = self._lib.seccomp_arch_resolve_name(architecture.encode())
            if not token:
                raise ValueError(f"libseccomp {version()} knows no architecture {architecture!r}")
            if token != self._lib.seccomp_arch_native():  # a new filter holds the native architecture only
                _check(self._lib.seccomp_arch_add(self._context, token), f"add architecture {architecture}")
                _check(self._lib.seccomp_arch_remove(self._context, _NATIVE), "remove the native architecture")

    def __enter__(self) -> Filter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        if self._context:
            self._lib.seccomp_release(self._context)
            self._context = None

    def add(self, action: int, syscall: str, *conditions: Comparison) -> None:
        """``action`` for ``syscall`` when every condition holds (all of them: libseccomp ANDs a rule's)."""
        number = syscall_number(syscall)
        raw = (_ArgCmp * len(conditions))(*(condition.raw() for condition in conditions))
        _check(self._lib.seccomp_rule_add_array(self._context, action, number, len(conditions), raw), syscall)

    def export_bpf(self) -> bytes:
        """The classic-BPF program: ``struct sock_filter`` entries in native byte order."""
        fd = os.memfd_create("seccomp_bpf")
        try:
            _check(self._lib.seccomp_export_bpf(self._context, fd), "export")
            return os.pread(fd, os.fstat(fd).st_size, 0)
        finally:
            os.close(fd)

    def load(self) -> None:
        """Install the filter on this process, every thread of it included (sets ``no_new_privs`` too)."""
        _check(self._lib.seccomp_attr_set(self._context, _ATTR_CTL_TSYNC, 1), "set thread sync")
        _check(self._lib.seccomp_load(self._context), "load")
