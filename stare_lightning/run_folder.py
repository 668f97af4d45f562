"""A run's output folder, held by descriptor once checked: no other local user can redirect what the run writes in it.

Another user who makes a run's ``output_dir`` first (mode 0777, say), or who may write it, can plant symbolic links
where the run writes (``server-token``, ``servers/server-0.log``), so that the run writes through them into a file of
the attacker's choosing, or replace the credential after the run wrote it. So a run

- refuses a folder owned by another user than itself or root (a folder's owner may rename anything in it) and one
  that group or others may write unless it is sticky (in a sticky folder only an entry's owner may rename or remove
  it), before it writes anything there;
- holds the checked folder open and creates or opens every file relative to that descriptor, never following a
  link (``O_NOFOLLOW``) and accepting only a regular file of its own: a path renamed or swapped after the check
  changes nothing.

Sub-folders (``servers/``) are checked the same way, opened relative to their parent's descriptor.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path
from typing import BinaryIO

__all__ = ["RunFolder", "UnsafeRunFolder", "not_own_regular_file"]

_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
# O_NONBLOCK: a FIFO planted under the name would otherwise block the open until someone reads it.
_APPEND_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_NEW_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeRunFolder(OSError):
    """The run's folder, or a file in it, is open to another local user. An ``OSError``: the run ends with this one
    line (``user_errors``)."""


class RunFolder:
    """The folder ``path`` (made if missing), checked and held open by descriptor. ``what`` names it in errors
    (``output_dir``). Close it when done (or use it as a context manager)."""

    def __init__(self, path: str | os.PathLike, *, what: str = "output_dir", fd: int | None = None) -> None:
        self.path, self.what = Path(path), what
        if fd is None:
            self.path.mkdir(parents=True, exist_ok=True)  # a folder that is there is checked before any write
            fd = os.open(self.path, _DIRECTORY_FLAGS)
        try:
            _check_folder(self.path, what, os.fstat(fd))
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd

    def folder(self, name: str) -> RunFolder:
        """The sub-folder ``name`` (made if missing, mode 0755 less the umask), checked like this one."""
        parent = self._descriptor()
        try:
            os.mkdir(name, 0o755, dir_fd=parent)
        except FileExistsError:
            pass
        try:
            fd = os.open(name, _DIRECTORY_FLAGS | os.O_NOFOLLOW, dir_fd=parent)
        except OSError as err:  # ELOOP or ENOTDIR: a link or a file stands at the name
            raise UnsafeRunFolder(
                f"{self.what} {self.path / name} is not a folder of this run ({err.strerror}): remove it, or use "
                "another output_dir"
            ) from None
        return RunFolder(self.path / name, what=f"{self.what}'s folder", fd=fd)

    def append(self, name: str) -> BinaryIO:
        """The file ``name`` opened for appending (made 0644 less the umask if missing): a regular file of this
        user's only, never through a link."""
        try:
            fd = os.open(name, _APPEND_FLAGS, 0o644, dir_fd=self._descriptor())
        except OSError as err:  # ELOOP: a symbolic link; ENXIO: a FIFO nobody reads
            raise UnsafeRunFolder(
                f"{self.path / name} cannot be opened as this run's file ({err.strerror}): remove it"
            ) from None
        problem = not_own_regular_file(os.fstat(fd))
        if problem is not None:
            os.close(fd)
            raise UnsafeRunFolder(f"{self.path / name} {problem}, not this run's file: remove it")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "ab")

    def write_private(self, name: str, text: str) -> Path:
        """Write ``text`` to ``name`` readable by this user only: a new 0600 file renamed over ``name``, both relative
        to this folder's descriptor, so no moment exists where it is readable by others and no link is followed."""
        folder = self._descriptor()
        temporary = f".{name}-{secrets.token_hex(6)}"
        fd = os.open(temporary, _NEW_FLAGS, 0o600, dir_fd=folder)
        try:
            with os.fdopen(fd, "w") as out:
                out.write(text + "\n")
            os.rename(temporary, name, src_dir_fd=folder, dst_dir_fd=folder)
        except BaseException:
            os.unlink(temporary, dir_fd=folder)
            raise
        return self.path / name

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunFolder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _descriptor(self) -> int:
        if self._fd is None:
            raise ValueError(f"the run folder {self.path} is closed")
        return self._fd


def not_own_regular_file(status: os.stat_result) -> str | None:
    """Why the file of ``status`` (taken on an open descriptor) is not a regular file of this user's, as the end of a
    sentence about it; None when it is one."""
    if not stat.S_ISREG(status.st_mode):
        return "is not a regular file"
    if status.st_uid != os.geteuid():
        return f"is owned by uid {status.st_uid}"
    return None


def _check_folder(path: Path, what: str, status: os.stat_result) -> None:
    if status.st_uid not in (os.geteuid(), 0):
        raise UnsafeRunFolder(
            f"{what} {path} is owned by uid {status.st_uid}, not by this user (uid {os.geteuid()}): its owner could "
            "replace what the run writes there (the servers' credential, their logs); use a folder you own"
        )
    mode = stat.S_IMODE(status.st_mode)
    writers = [who for who, bit in (("its group", stat.S_IWGRP), ("other users", stat.S_IWOTH)) if mode & bit]
    if writers and not mode & stat.S_ISVTX:
        raise UnsafeRunFolder(
            f"{what} {path} is writable by {' and '.join(writers)} (mode {mode:04o}) and not sticky: another user "
            f"could plant links where the run writes; use a folder only you can write (chmod go-w {path})"
        )
