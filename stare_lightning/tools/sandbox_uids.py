"""The uids sandboxed calls run as when the trainer is root: one of its own per call, drawn at random.

A uid of its own makes ``RLIMIT_NPROC`` count the call's processes only, and lets the host find them all. It is
never a uid that ``/etc/passwd`` or a gid that ``/etc/group`` names (their users' processes would share the count
and be swept with the call), never one that has a live process, and never one another call of this trainer holds.
"""

from __future__ import annotations

import os
import secrets
import threading
from dataclasses import dataclass, field
from pathlib import Path

from stare_lightning.tools.sandbox_process import processes_of_uid

__all__ = ["SandboxUids"]

_UID_FLOOR = 100_000  # drawn above this where the namespace maps enough uids, away from real users
_DRAWS = 64


def _mapped_range() -> tuple[int, int]:
    """The uids a call may run as: the widest range this user namespace maps, above ``_UID_FLOOR`` where it can;
    (0, 0) when there is none to draw from."""
    try:
        rows = [tuple(map(int, line.split())) for line in Path("/proc/self/uid_map").read_text().splitlines()]
    except OSError:
        rows = []
    low, count = max(((row[0], row[2]) for row in rows), key=lambda r: r[1], default=(0, 65536))
    high = low + count - 2  # the last mapped uid is often the overflow uid (nobody)
    if high > _UID_FLOOR + 1000:
        return max(low + 1, _UID_FLOOR), high
    return ((low + high) // 2, high) if high > low + 1 else (0, 0)


def _named_ids() -> set[int]:
    """The uids of /etc/passwd and gids of /etc/group (a call's gid is its uid)."""
    named = set()
    for path in ("/etc/passwd", "/etc/group"):
        try:
            lines = Path(path).read_text(errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            parts = line.split(":")
            if len(parts) > 2 and parts[2].strip().isdigit():
                named.add(int(parts[2]))
    return named


@dataclass
class SandboxUids:
    low: int
    high: int  # (0, 0): no uid of its own (not root, or nothing to draw from): calls run as the trainer's uid
    named: set[int] = field(default_factory=set)
    _held: set[int] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def for_this_process(cls) -> SandboxUids:
        if os.geteuid() != 0:
            return cls(0, 0)
        low, high = _mapped_range()
        return cls(low, high, _named_ids())

    def draw(self) -> int:
        """A free uid for one call (0: none, the call keeps the trainer's uid); ``release`` it after the call."""
        if not self.high:
            return 0
        for _ in range(_DRAWS):
            uid = self.low + secrets.randbelow(self.high - self.low + 1)
            if uid in self.named or processes_of_uid(uid):
                continue
            with self._lock:
                if uid not in self._held:
                    self._held.add(uid)
                    return uid
        raise RuntimeError(f"no free sandbox uid in {self.low}..{self.high} after {_DRAWS} draws")

    def release(self, uid: int) -> None:
        with self._lock:
            self._held.discard(uid)
