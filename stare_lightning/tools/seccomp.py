"""The seccomp rule sets of the python tool's sandbox and of the verifier worker, built with libseccomp.

Both refuse the kernel interfaces that neither a Python tool call nor a verifier needs, and allow the rest:
- ``DENIED`` fail with EPERM: namespaces (``unshare``, ``setns``), mounts (old and new API), io_uring, eBPF,
  keyrings, ``perf_event_open``, ``ptrace`` and the other ways into another process (its memory, its file
  descriptors, ``kcmp``), ``userfaultfd``, kernels and modules, file handles (which open a file by inode, past
  the directories a bind mount hides), and the administration calls (clock, swap, reboot, quotas, accounting,
  kernel log, port I/O) that a process without capabilities is refused anyway;
- ``clone`` with any ``CLONE_NEW*`` flag fails with EPERM (``fork``, threads and ``vfork`` pass); ``clone3``
  fails with ENOSYS: its flags sit in a struct in memory that seccomp cannot read, and on ENOSYS the C library
  falls back to ``clone``, whose flags are a register;
- ``socket`` and ``socketpair`` of a family outside the rule set's range fail with EAFNOSUPPORT: the sandbox
  keeps ``AF_UNIX`` and ``AF_INET`` (its network namespace has only its own loopback; IPv6 is refused, nothing
  a call needs uses it), the verifier worker ``AF_UNIX`` only. ``AF_NETLINK``, ``AF_PACKET``, ``AF_VSOCK``,
  ``AF_ALG``, ``AF_BLUETOOTH`` and the rest reach kernel code a sandbox has no use for;
- a syscall of another ABI (i386 or x32 on x86_64) kills the process: its numbers mean other calls.

libseccomp (``libseccomp.py``) resolves the names to the architecture's numbers and writes the program, so the
rules hold on every architecture it knows. The sandbox passes the exported program to ``bwrap --seccomp`` (or
its launcher loads it, with ``rlimits_unsafe``); the verifier worker loads its rule set itself (``load``), last.
"""

from __future__ import annotations

import errno
import functools
import socket
from dataclasses import dataclass

from stare_lightning.tools.libseccomp import ACT_ALLOW, Comparison, Filter, LibseccompMissing, act_errno

__all__ = [
    "DENIED",
    "SANDBOX",
    "VERIFIER",
    "RuleSet",
    "SeccompUnavailable",
    "filter_bytes",
    "filter_for_this_machine",
    "load",
]

CLONE_NAMESPACE_FLAGS = {
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}  # CLONE_NEWTIME (0x80) is unshare/clone3 only: in clone's flags those bits are the exit signal

DENIED = (
    # namespaces and mounts
    "unshare",
    "setns",
    "mount",
    "umount2",
    "pivot_root",
    "open_tree",
    "move_mount",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    # kernel interfaces with a history of privilege escalations
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "bpf",
    "keyctl",
    "add_key",
    "request_key",
    "perf_event_open",
    "userfaultfd",
    # other processes
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "process_madvise",
    "pidfd_getfd",
    "kcmp",
    # kernels, modules, file handles
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "name_to_handle_at",
    "open_by_handle_at",
    # administration
    "acct",
    "reboot",
    "swapon",
    "swapoff",
    "syslog",
    "quotactl",
    "quotactl_fd",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "iopl",
    "ioperm",
    "fanotify_init",
    "lookup_dcookie",
    "uselib",
)


@dataclass(frozen=True)
class RuleSet:
    """``DENIED`` and the namespace flags of ``clone`` for all; the socket families each allows (a range)."""

    name: str
    lowest_family: int
    highest_family: int


SANDBOX = RuleSet("the python tool's sandbox", socket.AF_UNIX, socket.AF_INET)
VERIFIER = RuleSet("the verifier worker", socket.AF_UNIX, socket.AF_UNIX)


class SeccompUnavailable(RuntimeError):
    """The filter cannot be built here (no libseccomp, or one that lacks a syscall or the architecture)."""


def _add_rules(program: Filter, rules: RuleSet) -> None:
    eperm, enosys, eafnosupport = act_errno(errno.EPERM), act_errno(errno.ENOSYS), act_errno(errno.EAFNOSUPPORT)
    for syscall in DENIED:
        program.add(eperm, syscall)
    program.add(enosys, "clone3")
    for flag in CLONE_NAMESPACE_FLAGS.values():  # a rule's comparisons are ANDed: one rule per flag
        program.add(eperm, "clone", Comparison(0, "&==", flag, mask=flag))
    for syscall in ("socket", "socketpair"):
        # 64-bit comparisons: a family with any high bit set is above the range, and refused.
        program.add(eafnosupport, syscall, Comparison(0, "<", rules.lowest_family))
        program.add(eafnosupport, syscall, Comparison(0, ">", rules.highest_family))


def _build(rules: RuleSet, architecture: str | None) -> Filter:
    program = None
    try:
        program = Filter(ACT_ALLOW, architecture)
        _add_rules(program, rules)
    except (LibseccompMissing, ValueError) as err:  # ValueError: a syscall or architecture it does not know
        if program is not None:
            program.close()
        raise SeccompUnavailable(f"the seccomp filter of {rules.name} cannot be built: {err}") from err
    return program


def filter_bytes(rules: RuleSet = SANDBOX, architecture: str | None = None) -> bytes:
    """The classic-BPF program of ``rules`` for ``architecture`` (libseccomp's name; default: this machine's), in
    the layout ``bwrap --seccomp FD`` and ``prctl(PR_SET_SECCOMP)`` read (``struct sock_filter``, native order)."""
    with _build(rules, architecture) as program:
        return program.export_bpf()


@functools.cache
def filter_for_this_machine() -> bytes:
    """The sandbox's program for this machine; ``SeccompUnavailable`` saying why and how to fix it otherwise."""
    return filter_bytes(SANDBOX)


def load(rules: RuleSet) -> None:
    """Install ``rules`` on this process and all its threads, for good (it sets ``no_new_privs`` too)."""
    with _build(rules, None) as program:
        program.load()
