"""The TCP ports a process listens on, read from /proc, and a connect-and-close flood of them by another local user.

``/proc/<pid>/net/tcp`` lists the sockets of the network namespace ``pid`` is in; a listener is one of the process's
own when its inode is among the process's descriptors.
"""

from __future__ import annotations

import os
from pathlib import Path

_LISTEN = "0A"


def listening_ports(pid: int) -> list[tuple[str, int]]:
    """``(address family "tcp" or "tcp6", port)`` of every socket ``pid`` listens on, in its own namespace."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    ports = []
    for family in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{family}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == _LISTEN and fields[9] in inodes:
                ports.append((family, int(fields[1].split(":")[1], 16)))
    return ports


def ports_listened_on_here() -> set[int]:
    """Every TCP port some process listens on in this process's network namespace, whoever owns it."""
    ports = set()
    for family in ("tcp", "tcp6"):
        for line in Path(f"/proc/self/net/{family}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == _LISTEN:
                ports.add(int(fields[1].split(":")[1], 16))
    return ports


def network_namespace(pid: int | str) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


def process_group(pid: int) -> list[int]:
    """Every process in ``pid``'s process group (a launched server's: its engine and worker too)."""
    group = os.getpgid(pid)
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == group:
                    members.append(int(entry))
            except ProcessLookupError:
                continue
    return members


# Run as the other user (tests/other_user.py): connect to each port on the host's loopback and close at once.
FLOOD = """
ports, rounds = {ports!r}, {rounds}
connected = refused = 0
for _ in range(rounds):
    for family, port in ports:
        sock = socket.socket(socket.AF_INET if family == "tcp" else socket.AF_INET6)
        try:
            sock.settimeout(2)
            sock.connect(("127.0.0.1" if family == "tcp" else "::1", port))
            connected += 1
        except OSError:
            refused += 1
        finally:
            sock.close()
print(json.dumps({{"connected": connected, "refused": refused}}))
"""


def server_pid(uds: str) -> int:
    """The process id of the vLLM server listening on the Unix socket ``uds`` (found by its command line)."""
    for entry in os.listdir("/proc"):
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"--uds" in argv and argv[argv.index(b"--uds") + 1] == uds.encode():
            return int(entry)
    raise LookupError(f"no server listens on {uds}")
