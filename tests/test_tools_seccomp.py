"""The seccomp rule sets, checked for what they say and for what the kernel then does.

The program libseccomp builds is run, instruction by instruction, on the ``struct seccomp_data`` of every syscall
number of x86_64 and aarch64 (and on ``clone``'s flags and ``socket``'s families), and each verdict is compared
with the expectation written out below, independently of ``seccomp.py``: an emptied, shortened or widened rule set
fails. Then every refused syscall and every socket family is tried inside a real sandbox (both local modes): each
must fail with its intended errno, and what a call needs (fork, threads, subprocesses, AF_UNIX and AF_INET sockets)
still works.
"""

from __future__ import annotations

import errno
import operator
import platform
import socket
import struct

import pytest

from stare_lightning.tools.libseccomp import syscall_name, syscall_number
from stare_lightning.tools.python_sandbox import PythonSandbox
from stare_lightning.tools.seccomp import SANDBOX, VERIFIER, SeccompUnavailable, filter_bytes

# What the rule sets must refuse with EPERM, written out here rather than read from seccomp.py.
MUST_REFUSE = {
    "unshare", "setns", "mount", "umount2", "pivot_root", "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount",
    "fspick", "mount_setattr", "io_uring_setup", "io_uring_enter", "io_uring_register", "bpf", "keyctl", "add_key",
    "request_key", "perf_event_open", "userfaultfd", "ptrace", "process_vm_readv", "process_vm_writev",
    "process_madvise", "pidfd_getfd", "kcmp", "kexec_load", "kexec_file_load", "init_module", "finit_module",
    "delete_module", "name_to_handle_at", "open_by_handle_at", "acct", "reboot", "swapon", "swapoff", "syslog",
    "quotactl", "quotactl_fd", "settimeofday", "clock_settime", "clock_adjtime", "iopl", "ioperm", "fanotify_init",
    "lookup_dcookie", "uselib",
}  # fmt: skip
NAMESPACE_FLAGS = [0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000]
SIGCHLD = 17
THREAD_FLAGS = 0x3D0F00  # what glibc's pthread_create passes to clone
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
ALLOW, KILL_PROCESS = 0x7FFF0000, 0x80000000
FAMILIES = {SANDBOX.name: {socket.AF_UNIX, socket.AF_INET}, VERIFIER.name: {socket.AF_UNIX}}
RULE_SETS = [pytest.param(SANDBOX, id="sandbox"), pytest.param(VERIFIER, id="verifier")]
MODES = [
    pytest.param("bubblewrap", marks=pytest.mark.needs("bwrap")),
    "rlimits_unsafe",
]


def _errno(number: int) -> int:
    return 0x00050000 | number


def run_program(program: bytes, nr: int, arch: int, args: tuple[int, ...] = ()) -> int:
    """What the classic-BPF ``program`` returns for a syscall: the kernel's interpreter, for the instructions a
    seccomp program may hold (an instruction outside them fails the test)."""
    padded = (tuple(args) + (0,) * 6)[:6]
    data = struct.pack("<iIQ6Q", nr, arch, 0, *padded)
    code = [struct.unpack_from("=HBBI", program, 8 * i) for i in range(len(program) // 8)]
    a = x = pc = 0
    memory = [0] * 16
    alu = {0x00: operator.add, 0x10: operator.sub, 0x20: operator.mul, 0x40: operator.or_, 0x50: operator.and_,
           0x60: operator.lshift, 0x70: operator.rshift, 0xA0: operator.xor}  # fmt: skip
    jumps = {0x10: operator.eq, 0x20: operator.gt, 0x30: operator.ge, 0x40: operator.and_}
    while True:
        op, jump_true, jump_false, k = code[pc]
        pc += 1
        kind, source = op & 0x07, (x if op & 0x08 else k)
        if op == 0x20:  # ld [k]
            a = struct.unpack_from("<I", data, k)[0]
        elif op in (0x00, 0x01):  # ld #k, ldx #k
            a, x = (k, x) if op == 0x00 else (a, k)
        elif op in (0x60, 0x61):  # ld M[k], ldx M[k]
            a, x = (memory[k], x) if op == 0x60 else (a, memory[k])
        elif op in (0x02, 0x03):  # st, stx
            memory[k] = a if op == 0x02 else x
        elif op in (0x07, 0x87):  # tax, txa
            a, x = (a, a) if op == 0x07 else (x, x)
        elif op in (0x06, 0x16):  # ret #k, ret a
            return k if op == 0x06 else a
        elif kind == 0x04 and op & 0xF0 in alu:
            a = alu[op & 0xF0](a, source) & 0xFFFFFFFF
        elif kind == 0x05 and op & 0xF0 == 0x00:  # ja
            pc += k
        elif kind == 0x05 and op & 0xF0 in jumps:
            pc += jump_true if jumps[op & 0xF0](a, source) else jump_false
        else:
            raise AssertionError(f"instruction {pc - 1}: opcode {op:#x} is not one a seccomp program may hold")


def _expected(name: str | None, rules, args: tuple[int, ...] = ()) -> int:
    if name in MUST_REFUSE:
        return _errno(errno.EPERM)
    if name == "clone3":
        return _errno(errno.ENOSYS)
    if name == "clone" and any(args[0] & flag for flag in NAMESPACE_FLAGS):
        return _errno(errno.EPERM)
    if name in ("socket", "socketpair") and args[0] not in FAMILIES[rules.name]:
        return _errno(errno.EAFNOSUPPORT)
    return ALLOW


@pytest.mark.parametrize("architecture", list(AUDIT_ARCH))
@pytest.mark.parametrize("rules", RULE_SETS)
def test_the_program_refuses_exactly_the_rule_set(rules, architecture):
    program = filter_bytes(rules, architecture)
    arch = AUDIT_ARCH[architecture]
    names = {number: syscall_name(number, architecture) for number in range(1024)}
    assert {"read", "mmap", "clone", "socket", "unshare"} <= set(names.values()), "libseccomp's table is incomplete"
    wrong = {}
    for number, name in names.items():
        verdict, expected = run_program(program, number, arch), _expected(name, rules, (0,))
        if name in ("clone", "socket", "socketpair"):
            continue  # by argument, below
        if verdict != expected:
            wrong[f"{name or 'unused'} ({number})"] = (hex(verdict), hex(expected))
    assert not wrong, f"verdicts (got, expected): {wrong}"
    numbers = {name: number for number, name in names.items() if name}
    clone_flags = [SIGCHLD, THREAD_FLAGS, 0x4111, *(flag | SIGCHLD for flag in NAMESPACE_FLAGS), (1 << 32) | 0x10000000]
    for flags in clone_flags:
        assert run_program(program, numbers["clone"], arch, (flags,)) == _expected("clone", rules, (flags,)), hex(flags)
    for family in [*range(64), 0xFFFFFFFF, (1 << 32) | socket.AF_UNIX, (1 << 64) - 1]:
        for name in ("socket", "socketpair"):
            verdict = run_program(program, numbers[name], arch, (family, socket.SOCK_STREAM, 0))
            assert verdict == _expected(name, rules, (family,)), (name, family, hex(verdict))
    # Another ABI's numbers mean other calls: i386 on x86_64, x32 (bit 30), aarch32 on aarch64.
    foreign = 0x40000003 if architecture == "x86_64" else 0x40000028
    assert run_program(program, numbers["read"], foreign) == KILL_PROCESS
    if architecture == "x86_64":
        assert run_program(program, 0x40000000 | numbers["read"], arch) == KILL_PROCESS


def test_the_check_fails_a_rule_set_emptied_or_short_of_one_call(monkeypatch):
    from stare_lightning.tools import seccomp

    for weaker in ((), tuple(name for name in seccomp.DENIED if name != "bpf")):
        monkeypatch.setattr(seccomp, "DENIED", weaker)
        with pytest.raises(AssertionError, match="bpf"):
            test_the_program_refuses_exactly_the_rule_set(SANDBOX, platform.machine())
    monkeypatch.undo()
    monkeypatch.setattr(seccomp, "SANDBOX", seccomp.RuleSet(SANDBOX.name, socket.AF_UNIX, socket.AF_INET6))
    with pytest.raises(AssertionError, match="socket"):
        test_the_program_refuses_exactly_the_rule_set(seccomp.SANDBOX, platform.machine())


def test_an_unknown_architecture_is_named():
    with pytest.raises(SeccompUnavailable, match="the python tool's sandbox.*no architecture 'vax'"):
        filter_bytes(SANDBOX, "vax")


@pytest.fixture(scope="module", params=MODES)
def sandbox(request):
    tool = PythonSandbox(isolation=request.param, timeout_seconds=20, cpu_seconds=10, max_output_chars=20_000)
    yield tool
    tool.close()


# Each call in a child of its own, with arguments of zero (harmless should the filter let one through: the
# sandbox's uid holds no capability) or this process (process_vm_readv of itself, which would succeed).
PROBE_SYSCALLS = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
for name, number in sorted({numbers!r}.items()):
    args = [os.getpid(), 0, 0, 0, 0, 0] if name == "process_vm_readv" else [0] * 6
    pid = os.fork()
    if pid == 0:
        result = libc.syscall(ctypes.c_long(number), *(ctypes.c_long(arg) for arg in args))
        print(name, "ALLOWED" if result >= 0 else ctypes.get_errno(), flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
"""


@pytest.mark.skipif(platform.machine() not in AUDIT_ARCH, reason="checked on x86_64 and aarch64")
def test_every_refused_syscall_fails_with_eperm_in_a_real_sandbox(sandbox):
    numbers = {name: syscall_number(name) for name in MUST_REFUSE}
    numbers = {name: number for name, number in numbers.items() if number >= 0}  # absent on this architecture
    assert len(numbers) > 40, numbers
    result = sandbox.run(PROBE_SYSCALLS.format(numbers=numbers))
    outcome = dict(line.split() for line in result.text.splitlines())
    assert set(outcome) == set(numbers), result.text
    wrong = {name: got for name, got in outcome.items() if got != str(errno.EPERM)}
    assert not wrong, f"not refused with EPERM: {wrong}"


PROBE_FAMILIES = """
import ctypes, errno, os, socket
kinds = (socket.SOCK_STREAM, socket.SOCK_DGRAM, socket.SOCK_SEQPACKET, socket.SOCK_RAW)
for family in range(64):
    opened, errors = [], set()
    for kind in kinds:
        try:
            socket.socket(family, kind).close()
            opened.append(kind)
        except OSError as err:
            errors.add(errno.errorcode.get(err.errno, str(err.errno)))
    print(family, "OPENED" if opened else ",".join(sorted(errors)))
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
# AF_UNIX with a high bit set in the register: the kernel reads an int (AF_UNIX), the filter all 64 bits.
result = libc.syscall(ctypes.c_long({socket_number}), ctypes.c_long((1 << 32) | 1), ctypes.c_long(1), ctypes.c_long(0))
print("high_bits", "OPENED" if result >= 0 else errno.errorcode[ctypes.get_errno()])
for family in (socket.AF_UNIX, socket.AF_INET6, socket.AF_NETLINK):
    try:
        socket.socketpair(family, socket.SOCK_STREAM)
        print("pair", family, "OPENED")
    except OSError as err:
        print("pair", family, errno.errorcode[err.errno])
"""


def test_only_unix_and_ipv4_sockets_open_in_a_real_sandbox(sandbox):
    result = sandbox.run(PROBE_FAMILIES.format(socket_number=syscall_number("socket")))
    lines = result.text.splitlines()
    families = dict(line.split() for line in lines if line.split()[0].isdigit())
    assert len(families) == 64, result.text
    assert families[str(socket.AF_UNIX)] == families[str(socket.AF_INET)] == "OPENED", result.text
    others = {family: got for family, got in families.items() if int(family) not in (socket.AF_UNIX, socket.AF_INET)}
    assert set(others.values()) == {"EAFNOSUPPORT"}, others  # AF_INET6, AF_NETLINK, AF_VSOCK (40), AF_PACKET...
    assert "high_bits EAFNOSUPPORT" in lines, result.text
    assert f"pair {socket.AF_UNIX} OPENED" in lines, result.text
    assert f"pair {socket.AF_INET6} EAFNOSUPPORT" in lines and f"pair {socket.AF_NETLINK} EAFNOSUPPORT" in lines


def test_a_missing_libseccomp_is_named_with_how_to_install_it(monkeypatch):
    from stare_lightning.tools import libseccomp
    from stare_lightning.tools.seccomp import filter_for_this_machine

    monkeypatch.setattr(libseccomp, "SONAME", "libseccomp.so.0-absent")  # what dlopen finds on a host without it
    libseccomp._library.cache_clear()
    filter_for_this_machine.cache_clear()
    try:
        with pytest.raises(SeccompUnavailable, match=r"libseccomp.so.0-absent cannot be loaded.*apt-get install lib"):
            PythonSandbox(isolation="rlimits_unsafe")
    finally:
        monkeypatch.undo()
        libseccomp._library.cache_clear()
        filter_for_this_machine.cache_clear()
