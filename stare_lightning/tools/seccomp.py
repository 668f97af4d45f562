"""A seccomp filter for the sandbox, as a classic-BPF program: the kernel interfaces a Python call never needs
(namespaces, mounts, io_uring, eBPF, keyrings, tracing, other processes' memory, kernel modules) fail with EPERM.

The program reads ``struct seccomp_data`` (``int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6]``) and:
- kills the process when the audit architecture is not the one the numbers below belong to (a 32-bit syscall
  on x86_64 has other numbers), and on x86_64 refuses x32 syscalls (numbers with bit 30 set) with ENOSYS;
- refuses each syscall of ``DENIED`` with EPERM;
- refuses ``clone`` with any ``CLONE_NEW*`` flag with EPERM (``fork``, threads and ``vfork`` pass), and ``clone3``
  with ENOSYS: its flags sit in a struct in memory that BPF cannot read, and on ENOSYS the C library falls back to
  ``clone``, whose flags are a register;
- allows everything else.

``filter_bytes()`` is the program in the layout ``bwrap --seccomp FD`` and ``prctl(PR_SET_SECCOMP)`` take: an
array of ``struct sock_filter { __u16 code; __u8 jt; __u8 jf; __u32 k; }`` in native byte order.
"""

from __future__ import annotations

import errno
import functools
import logging
import platform
import struct
from dataclasses import dataclass

__all__ = ["DENIED", "SeccompUnsupported", "filter_bytes", "filter_for_this_machine", "supported"]

logger = logging.getLogger(__name__)

# Classic BPF opcodes (linux/bpf_common.h): load a 32-bit word at an absolute offset, compare-and-jump, return.
LOAD_WORD = 0x00 | 0x00 | 0x20  # BPF_LD | BPF_W | BPF_ABS
JUMP_EQUAL = 0x05 | 0x10 | 0x00  # BPF_JMP | BPF_JEQ | BPF_K
JUMP_GREATER_EQUAL = 0x05 | 0x30 | 0x00  # BPF_JMP | BPF_JGE | BPF_K
JUMP_ANY_BIT = 0x05 | 0x40 | 0x00  # BPF_JMP | BPF_JSET | BPF_K
RETURN = 0x06 | 0x00  # BPF_RET | BPF_K

# Return values (linux/seccomp.h).
ALLOW = 0x7FFF0000
KILL_PROCESS = 0x80000000
ERRNO = 0x00050000  # | the errno, in the low 16 bits

# Offsets in struct seccomp_data.
NR_OFFSET = 0
ARCH_OFFSET = 4
ARGS_OFFSET = 16  # args[0]; each argument is 8 bytes

CLONE_NAMESPACE_FLAGS = (
    0x00020000  # CLONE_NEWNS
    | 0x02000000  # CLONE_NEWCGROUP
    | 0x04000000  # CLONE_NEWUTS
    | 0x08000000  # CLONE_NEWIPC
    | 0x10000000  # CLONE_NEWUSER
    | 0x20000000  # CLONE_NEWPID
    | 0x40000000  # CLONE_NEWNET
)  # CLONE_NEWTIME (0x80) is unshare/clone3 only: in clone's flags those bits are the exit signal
X32_SYSCALL_BIT = 0x40000000

DENIED = (
    "unshare", "setns", "mount", "umount2", "pivot_root", "open_tree", "move_mount", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr", "io_uring_setup", "io_uring_enter", "io_uring_register", "bpf", "keyctl",
    "add_key", "request_key", "perf_event_open", "ptrace", "userfaultfd", "process_vm_readv", "process_vm_writev",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "name_to_handle_at",
    "open_by_handle_at",
)  # fmt: skip


@dataclass(frozen=True)
class _Arch:
    audit: int  # AUDIT_ARCH_* (linux/audit.h)
    numbers: dict[str, int]  # syscall numbers (asm/unistd_64.h; asm-generic/unistd.h for aarch64)
    x32: bool  # whether the x32 ABI shares this audit arch


_X86_64 = _Arch(
    audit=0xC000003E,
    numbers={"unshare": 272, "setns": 308, "clone": 56, "clone3": 435, "mount": 165, "umount2": 166,
             "pivot_root": 155, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
             "fspick": 433, "mount_setattr": 442, "io_uring_setup": 425, "io_uring_enter": 426,
             "io_uring_register": 427, "bpf": 321, "keyctl": 250, "add_key": 248, "request_key": 249,
             "perf_event_open": 298, "ptrace": 101, "userfaultfd": 323, "process_vm_readv": 310,
             "process_vm_writev": 311, "kexec_load": 246, "kexec_file_load": 320, "init_module": 175,
             "finit_module": 313, "delete_module": 176, "name_to_handle_at": 303, "open_by_handle_at": 304},
    x32=True,
)  # fmt: skip
_AARCH64 = _Arch(
    audit=0xC00000B7,
    numbers={"unshare": 97, "setns": 268, "clone": 220, "clone3": 435, "mount": 40, "umount2": 39,
             "pivot_root": 41, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
             "fspick": 433, "mount_setattr": 442, "io_uring_setup": 425, "io_uring_enter": 426,
             "io_uring_register": 427, "bpf": 280, "keyctl": 219, "add_key": 217, "request_key": 218,
             "perf_event_open": 241, "ptrace": 117, "userfaultfd": 282, "process_vm_readv": 270,
             "process_vm_writev": 271, "kexec_load": 104, "kexec_file_load": 294, "init_module": 105,
             "finit_module": 273, "delete_module": 106, "name_to_handle_at": 264, "open_by_handle_at": 265},
    x32=False,
)  # fmt: skip
_ARCHES = {"x86_64": _X86_64, "amd64": _X86_64, "aarch64": _AARCH64, "arm64": _AARCH64}


class SeccompUnsupported(RuntimeError):
    """The machine's architecture has no syscall table here."""


def supported(machine: str | None = None) -> bool:
    return (machine or platform.machine()).lower() in _ARCHES


def _instruction(code: int, k: int, jump_true: int = 0, jump_false: int = 0) -> bytes:
    if not (0 <= jump_true <= 255 and 0 <= jump_false <= 255):
        raise ValueError("a classic-BPF jump reaches at most 255 instructions ahead")
    return struct.pack("=HBBI", code, jump_true, jump_false, k)


def _deny_if_equal(number: int, result: int) -> list[bytes]:
    """``if nr == number: return result`` (the accumulator holds nr)."""
    return [_instruction(JUMP_EQUAL, number, 0, 1), _instruction(RETURN, result)]


def filter_bytes(machine: str | None = None) -> bytes:
    """The filter for ``machine`` (default: this one); ``SeccompUnsupported`` for an architecture without a table."""
    name = (machine or platform.machine()).lower()
    arch = _ARCHES.get(name)
    if arch is None:
        raise SeccompUnsupported(f"no seccomp syscall table for the {name!r} architecture (known: x86_64, aarch64)")
    eperm, enosys = ERRNO | errno.EPERM, ERRNO | errno.ENOSYS
    program = [
        _instruction(LOAD_WORD, ARCH_OFFSET),
        _instruction(JUMP_EQUAL, arch.audit, 1, 0),
        _instruction(RETURN, KILL_PROCESS),
        _instruction(LOAD_WORD, NR_OFFSET),
    ]
    if arch.x32:
        program += [_instruction(JUMP_GREATER_EQUAL, X32_SYSCALL_BIT, 0, 1), _instruction(RETURN, enosys)]
    for syscall in DENIED:
        program += _deny_if_equal(arch.numbers[syscall], eperm)
    program += _deny_if_equal(arch.numbers["clone3"], enosys)
    # clone: refused when its flags (args[0]; the low word is at the lower address on both architectures,
    # which are little-endian) ask for a new namespace.
    program += [
        _instruction(JUMP_EQUAL, arch.numbers["clone"], 0, 3),
        _instruction(LOAD_WORD, ARGS_OFFSET),
        _instruction(JUMP_ANY_BIT, CLONE_NAMESPACE_FLAGS, 0, 1),
        _instruction(RETURN, eperm),
        _instruction(RETURN, ALLOW),
    ]
    return b"".join(program)


@functools.cache
def filter_for_this_machine() -> bytes | None:
    """This machine's filter; None, with a warning (once), where its architecture has no syscall table."""
    try:
        return filter_bytes()
    except SeccompUnsupported as err:
        logger.warning("sandbox: running without a seccomp filter: %s", err)
        return None
