"""The trainer's weight-transfer directory, held by descriptor so that no other local user can redirect a push.

A push writes chunk files the servers load as the policy's weights. If ``rollout.server.transfer_dir`` lies in a
directory other users may write, one of them can rename the trainer's directory away and put one of their own in
its place: a trainer that wrote by path would then write through links planted there (overwriting files elsewhere)
or leave its chunks where the attacker can replace them. So the trainer

- refuses a base directory that group or others may write unless it is sticky (in a sticky directory only an
  entry's owner may rename or remove it), and one owned by another user than itself or root (a directory's owner
  may rename anything in it, sticky or not);
- creates its own directory (0700) inside the base through the base's descriptor, keeps it open, and creates every
  chunk relative to that descriptor with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode 0600: no path is resolved
  again after the start, so nothing planted later can redirect a write;
- checks before every push that the path the servers were given still names the directory it holds (same
  ``st_dev`` and ``st_ino``): a directory replaced mid-run ends the run with one line saying so.

The servers' side (``transfer_engine.py``) refuses a directory not owned by its own user and opens every chunk
relative to its own descriptor.
"""

from __future__ import annotations

import atexit
import os
import secrets
import stat
from pathlib import Path
from typing import BinaryIO

from stare_lightning.run_folder import HeldDirectory

__all__ = ["ChunkDirectory", "TransferDirectory", "UnsafeTransferDirectory", "check_transfer_base"]

_PREFIX = "stare-lightning-weights-"
_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
# A chunk is always a new file: O_EXCL refuses a name that exists (a planted file or link), O_NOFOLLOW a link.
_CHUNK_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeTransferDirectory(OSError):
    """The weight-transfer directory, or the directory it is made in, is open to other users or was replaced.
    An ``OSError``: the run ends with this one line (``user_errors``)."""


def default_base() -> Path:
    """/dev/shm when it is there and writable (the chunks then never reach a disk), else tempfile's directory."""
    import tempfile

    shm = "/dev/shm"
    return Path(shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else tempfile.gettempdir())


def check_transfer_base(base: str | Path) -> None:
    """Refuse ``base`` (``rollout.server.transfer_dir``) when another user could replace what the run makes in it.
    Cheap: called where the run reaches its servers, before any model is loaded."""
    fd = _open_directory(Path(base))
    try:
        _check_base(Path(base), os.fstat(fd))
    finally:
        os.close(fd)


class ChunkDirectory(HeldDirectory):
    """An existing directory held open by descriptor: chunk files are created, listed and removed relative to it,
    never by path."""

    kind = "chunk directory"

    def __init__(self, path: str | Path, *, fd: int | None = None) -> None:
        self.path = Path(path)
        self._fd: int | None = fd if fd is not None else os.open(self.path, _DIRECTORY_FLAGS | os.O_NOFOLLOW)

    def create(self, name: str) -> BinaryIO:
        """A new file ``name`` (mode 0600) in this directory, open for writing; refused if the name exists."""
        fd = os.open(name, _CHUNK_FLAGS, 0o600, dir_fd=self._descriptor())
        return os.fdopen(fd, "wb")

    def create_directory(self, name: str) -> ChunkDirectory:
        """A new sub-directory ``name`` (mode 0700), held by descriptor like this one (a LoRA adapter's files);
        refused if the name exists. Close it when written."""
        parent = self._descriptor()
        os.mkdir(name, 0o700, dir_fd=parent)
        fd = os.open(name, _DIRECTORY_FLAGS | os.O_NOFOLLOW, dir_fd=parent)
        os.fchmod(fd, 0o700)  # whatever the umask left of the mode
        return ChunkDirectory(self.path / name, fd=fd)

    def names(self) -> list[str]:
        return sorted(os.listdir(self._descriptor()))

    def delete(self, name: str) -> None:
        """Delete the file or sub-directory ``name`` (a sub-directory with the files in it)."""
        fd = self._descriptor()
        if not stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
            os.unlink(name, dir_fd=fd)
            return
        with ChunkDirectory(self.path / name, fd=os.open(name, _DIRECTORY_FLAGS | os.O_NOFOLLOW, dir_fd=fd)) as sub:
            sub.clear()
        os.rmdir(name, dir_fd=fd)

    def clear(self) -> None:
        """Remove everything in the directory (a push leaves nothing behind)."""
        for name in os.listdir(self._descriptor()):
            self.delete(name)


class TransferDirectory(ChunkDirectory):
    """A fresh private directory for one run's pushes, made inside ``under`` (``rollout.server.transfer_dir``; None:
    ``default_base()``) once the base is checked. ``remove`` deletes it."""

    def __init__(self, under: str | Path | None = None) -> None:
        # Absolute: the servers get paths inside it and would resolve a relative one against their own directory.
        base = Path(under).absolute() if under is not None else default_base()
        base_fd = _open_directory(base)
        try:
            _check_base(base, os.fstat(base_fd))
            name = _PREFIX + secrets.token_hex(8)
            os.mkdir(name, 0o700, dir_fd=base_fd)
            fd = os.open(name, _DIRECTORY_FLAGS | os.O_NOFOLLOW, dir_fd=base_fd)
        except BaseException:
            os.close(base_fd)
            raise
        os.fchmod(fd, 0o700)  # whatever the umask left of the mode
        status = os.fstat(fd)
        self.path, self.name, self._fd, self._base_fd = base / name, name, fd, base_fd
        self._identity = (status.st_dev, status.st_ino)
        # A run that ends on an error may never reach the engine's close: /dev/shm is memory, leave nothing there.
        atexit.register(self.remove)

    def check_in_place(self) -> None:
        """Raise ``UnsafeTransferDirectory`` unless the path still names the directory this object holds."""
        try:
            status = os.stat(self.path, follow_symlinks=False)
            found = (status.st_dev, status.st_ino)
        except OSError:
            found = None
        if found != self._identity:
            raise UnsafeTransferDirectory(
                f"the weight-transfer directory {self.path} was replaced since the run created it (renamed, removed "
                "or swapped by another process): the servers could load someone else's chunks, so the run stops "
                "before pushing; use a rollout.server.transfer_dir only you can write"
            )

    def remove(self) -> None:
        """Delete the chunks and the directory (only if the path still names it), and close the descriptors."""
        atexit.unregister(self.remove)
        if self._fd is None:
            return
        self.clear()
        in_place = True
        try:
            self.check_in_place()
        except UnsafeTransferDirectory:
            in_place = False  # the name now belongs to someone else's directory: leave it alone
        self.close()
        try:
            if in_place:
                os.rmdir(self.name, dir_fd=self._base_fd)
        finally:
            os.close(self._base_fd)


def _open_directory(path: Path) -> int:
    try:
        return os.open(path, _DIRECTORY_FLAGS)
    except FileNotFoundError:
        raise FileNotFoundError(f"rollout.server.transfer_dir {path} does not exist: create it first") from None
    except NotADirectoryError:
        raise NotADirectoryError(f"rollout.server.transfer_dir {path} is not a directory") from None


def _check_base(path: Path, status: os.stat_result) -> None:
    mode = stat.S_IMODE(status.st_mode)
    writers = [who for who, bit in (("its group", stat.S_IWGRP), ("other users", stat.S_IWOTH)) if mode & bit]
    if writers and not mode & stat.S_ISVTX:
        raise UnsafeTransferDirectory(
            f"rollout.server.transfer_dir {path} is writable by {' and '.join(writers)} (mode {mode:04o}) and not "
            "sticky: another user could replace the run's weights directory inside it; use a directory only you can "
            f"write (chmod go-w {path}) or a sticky one (chmod +t {path}, as /tmp and /dev/shm are)"
        )
    if status.st_uid not in (os.geteuid(), 0):
        raise UnsafeTransferDirectory(
            f"rollout.server.transfer_dir {path} is owned by uid {status.st_uid}, not by this user (uid "
            f"{os.geteuid()}) or root: its owner could replace the run's weights directory inside it; use a "
            "directory you own"
        )
