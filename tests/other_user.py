"""A second, unprivileged local user for the tests that play an attacker on the same host.

``other_user`` creates one when the tests run as root (``useradd``; removed afterwards) and otherwise skips the test,
or fails it under ``CI=true`` (tests/needs.py; the CI runs as root). The attacker's code runs in a process of its own
that starts as root and drops to the user (``setgroups``, ``setgid``, ``setuid``) before its own code runs: the
project's interpreter may lie where that user cannot read it, and from the drop on the kernel checks every access as
it does for that user.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.needs import require

# Imported before the drop: once the process is the other user, the interpreter's own library may be out of reach.
_DROP = """
import encodings.idna, errno, json, os, socket, sys, time
os.setgroups([])
os.setgid({gid})
os.setuid({uid})
assert os.geteuid() == {uid} and os.getegid() == {gid}
"""


@dataclass(frozen=True)
class OtherUser:
    name: str
    uid: int
    gid: int

    def _command(self, code: str) -> list[str]:
        return [sys.executable, "-I", "-c", _DROP.format(uid=self.uid, gid=self.gid) + code]

    def run(self, code: str, *, timeout: float = 60) -> dict:
        """Run ``code`` as this user; it prints one JSON object as its last line, which is returned."""
        done = subprocess.run(self._command(code), capture_output=True, text=True, timeout=timeout, cwd="/")
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    def start(self, code: str) -> subprocess.Popen:
        """Start ``code`` as this user in the background (stdout piped: ``finish`` reads its JSON line)."""
        return subprocess.Popen(self._command(code), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")

    @staticmethod
    def finish(process: subprocess.Popen, timeout: float = 60) -> dict:
        out, err = process.communicate(timeout=timeout)
        assert process.returncode == 0, err[-2000:]
        return json.loads(out.strip().splitlines()[-1])


@pytest.fixture
def other_user():
    require("other_user")
    name = f"stare-probe-{os.getpid()}"
    made = subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "--user-group", name],
        capture_output=True,
        text=True,
    )
    assert made.returncode == 0, f"useradd {name} failed: {made.stderr.strip()}"
    try:
        import pwd

        entry = pwd.getpwnam(name)
        yield OtherUser(name, entry.pw_uid, entry.pw_gid)
    finally:
        subprocess.run(["userdel", name], capture_output=True)


@pytest.fixture
def shared_scratch():
    """A scratch directory both users can reach (pytest's own lie in root's private /tmp/pytest-of-root)."""
    path = Path(tempfile.mkdtemp(prefix="stare-probe-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        subprocess.run(["rm", "-rf", str(path)], check=False)
