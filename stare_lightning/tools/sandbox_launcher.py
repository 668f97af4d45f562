"""The launcher: what runs before the policy's code in a local sandbox, as its own script (``python -I -B -c``).

It runs in the sandbox's interpreter and imports nothing of this package. ``sys.argv[1]`` is a JSON object of
settings (``python_sandbox`` writes it). In every mode it sets the resource limits of the call's code (CPU
seconds, address space, file size, processes, open files, no core files), gives up root for the call's own uid
when one is given (so that the process limit applies and counts only the call's processes), enters the scratch
directory and executes the replay program in this same interpreter.

With ``isolation=rlimits_unsafe`` (no bubblewrap around it) it first isolates the call itself, as far as the
kernel lets it: new mount, pid, network, ipc and uts namespaces (as root; otherwise inside a new user namespace;
otherwise none). The launcher forks an init (pid 1 of the new pid namespace, killed when the launcher dies), the
init mounts a private ``/tmp`` and ``/dev/shm``, a ``/proc`` of the namespace, hides the host's home directories
and secret files, and forks the code. When the code exits the init exits, and the kernel kills whatever else the
call started. Without namespaces the init is a child subreaper instead: orphans of the call come back to it and
are killed. The code process then loads the seccomp filter when one is given.
"""

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_SECCOMP, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 22, 36, 38
SECCOMP_MODE_FILTER = 2
LIBC = ctypes.CDLL(None, use_errno=True)


def _check(result, what):
    if result != 0:
        number = ctypes.get_errno()
        raise OSError(number, f"{what}: {os.strerror(number)}")


def _unshare():
    """Enter new namespaces: "root" (as root), "user" (inside a new user namespace) or "" (none allowed)."""
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    if LIBC.unshare(flags) == 0:
        return "root"
    uid, gid = os.getuid(), os.getgid()
    if LIBC.unshare(flags | CLONE_NEWUSER) != 0:
        return ""
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as handle:
            handle.write(text)
    return "user"


def _mount(source, target, fstype, flags, data=None):
    encode = lambda text: None if text is None else text.encode()  # noqa: E731
    _check(LIBC.mount(encode(source), encode(target), encode(fstype), flags, encode(data)), f"mount {target}")


def _inside(path, parent):
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _private_mounts(settings):
    """The call's own view of the file system (in the new mount namespace; the host's is untouched)."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    hidden = [path for path in settings["hidden"] if os.path.isdir(path)]
    # The runtime under a directory mounted over below (a hidden one, or a virtual environment under /tmp),
    # opened before it is covered and bound back afterwards.
    covered = [*hidden, "/tmp", "/dev/shm"]
    runtime = {p: os.open(p, os.O_PATH) for p in settings["runtime"] if any(_inside(p, c) for c in covered)}
    for path in hidden:
        _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    size = f"size={int(settings['scratch_mb'])}m,mode=1777"
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, size)
    if os.path.isdir("/dev/shm"):
        _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, size)
    for path, fd in runtime.items():
        os.makedirs(path, mode=0o755, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        try:  # in a user namespace the source's locked flags may refuse this: the files stay the user's own
            _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | (os.statvfs(path).f_flag & 14))
        except OSError:
            pass
        os.close(fd)
    for path in hidden:
        _mount(None, path, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    for path in settings["secrets"]:
        if os.path.isfile(path):  # /dev/null on a nodev mount: opening it fails, as bwrap's binds do
            _mount("/dev/null", path, None, MS_BIND)
            _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
        elif os.path.isdir(path):
            _mount("tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=755")
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)


def _exit_like(status):
    """Exit as a shell reports ``status``: its exit code, or 128 + the signal that killed it."""
    code = os.waitstatus_to_exitcode(status)
    os._exit(code if code >= 0 else 128 - code)


def _children():
    pids = set()
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as handle:
                pids.update(int(pid) for pid in handle.read().split())
        except OSError:
            continue
    return pids


def _init(code_pid, pid_namespace):
    """Reap until the code exits; then exit with its status (in a pid namespace that ends every process of the
    call). Without one, kill the orphans that came back to this subreaper first."""
    status = None
    while status is None:
        try:
            pid, raw = os.wait()
        except ChildProcessError:
            break
        if pid == code_pid:
            status = raw
    while not pid_namespace and _children():
        for pid in _children():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            os.wait()
        except ChildProcessError:
            pass
    _exit_like(status if status is not None else 1 << 8)


def _isolate(settings):
    """Namespaces, an init and the code process; returns, in the code process only, its working directory."""
    namespaces = _unshare()
    init = os.fork()
    if init:  # the launcher: the host's child, outside the pid namespace
        _exit_like(os.waitpid(init, 0)[1])
    # The init dies with the launcher (which the host kills at the time limit), and the namespace with the init.
    LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if namespaces:
        _private_mounts(settings)
    else:
        LIBC.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    code = os.fork()
    if code:
        _init(code, pid_namespace=bool(namespaces))
    if not namespaces:
        LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    return settings["workdir"] if namespaces else settings["host_workdir"], namespaces


def _set_limits(settings):
    mb = 1024 * 1024
    cpu = int(settings["cpu_seconds"])
    for kind, limit in (
        (resource.RLIMIT_CORE, (0, 0)),
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_AS, (int(settings["memory_mb"]) * mb,) * 2),
        (resource.RLIMIT_FSIZE, (int(settings["file_size_mb"]) * mb,) * 2),
        (resource.RLIMIT_NPROC, (int(settings["max_processes"]),) * 2),
        (resource.RLIMIT_NOFILE, (int(settings["max_open_files"]),) * 2),
    ):
        resource.setrlimit(kind, limit)


def _drop_privileges(uid, workdir, namespaces):
    """Give up root for ``uid``; in a user namespace, give up the namespace's capabilities."""
    if uid:
        os.chown(workdir, uid, uid)
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        if os.getuid() != uid or os.geteuid() != uid or os.getegid() != uid:
            sys.exit("sandbox: could not give up root")
    elif namespaces == "user":

        class Header(ctypes.Structure):
            _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

        empty = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable x 2: nothing
        _check(LIBC.capset(ctypes.byref(Header(0x20080522, 0)), empty), "capset")


def _load_seccomp(program):
    class Program(ctypes.Structure):
        _fields_ = [("length", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    _check(LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    fprog = Program(len(program) // 8, program)
    _check(LIBC.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "seccomp")


def main(settings):
    """Returns the program to run, once this process is the call's code process with every limit in place."""
    with open(settings["program"], encoding="utf-8") as handle:
        program = handle.read()
    workdir, namespaces, seccomp = settings["workdir"], "", None
    if settings["mode"] == "rlimits_unsafe":
        if settings["seccomp"]:
            with open(settings["seccomp"], "rb") as handle:
                seccomp = handle.read()
        workdir, namespaces = _isolate(settings)
    os.makedirs(workdir, exist_ok=True)
    os.environ["HOME"] = os.environ["TMPDIR"] = workdir
    _set_limits(settings)
    _drop_privileges(int(settings["uid"]), workdir, namespaces)
    os.chdir(workdir)
    if seccomp:
        _load_seccomp(seccomp)
    sys.argv = ["<code>"]
    return program


if __name__ == "__main__":
    exec(compile(main(json.loads(sys.argv[1])), "<runner>", "exec"), {"__name__": "__main__"})
