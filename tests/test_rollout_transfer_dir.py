"""The trainer's weight-transfer directory (rollout/transfer_dir.py): what base directories it refuses, that
its chunks are created by descriptor (never through a name planted in the directory), and that a directory replaced
by another local user is noticed, with a real second user where the case needs one (tests/other_user.py)."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from stare_lightning.rollout.server.shared.transfer import write_chunks
from stare_lightning.rollout.transfer_dir import (
    ChunkDirectory,
    TransferDirectory,
    UnsafeTransferDirectory,
    check_transfer_base,
)

WEIGHTS = [("a.weight", torch.arange(6, dtype=torch.float32).reshape(2, 3)), ("b.bias", torch.ones(4))]


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_fresh_directory_is_private_and_its_chunks_are_0600(tmp_path):
    tmp_path.chmod(0o755)
    directory = TransferDirectory(tmp_path)
    try:
        assert directory.path.parent == tmp_path and _mode(directory.path) == 0o700
        (info,) = write_chunks(WEIGHTS, directory)
        assert _mode(directory.path / info["file"]) == 0o600
        assert (directory.path / info["file"]).stat().st_size == 24 + 16
        directory.clear()
        assert directory.names() == []
    finally:
        directory.remove()
    assert not directory.path.exists()


def test_the_default_base_is_shared_memory():
    directory = TransferDirectory()
    try:
        if os.access("/dev/shm", os.W_OK):
            assert str(directory.path.parent) == "/dev/shm"
    finally:
        directory.remove()


@pytest.mark.parametrize(
    ("mode", "refusal"),
    [(0o775, "writable by its group"), (0o777, "its group and other users"), (0o757, "writable by other users")],
)
def test_a_base_others_may_write_is_refused_unless_sticky(tmp_path, mode, refusal):
    base = tmp_path / "base"
    base.mkdir()
    base.chmod(mode)
    for attempt in (lambda: check_transfer_base(base), lambda: TransferDirectory(base)):
        with pytest.raises(UnsafeTransferDirectory, match=f"{refusal} .*not sticky"):
            attempt()
    assert list(base.iterdir()) == []  # refused before anything was made in it
    base.chmod(mode | stat.S_ISVTX)  # sticky: only an entry's owner may rename it
    check_transfer_base(base)
    TransferDirectory(base).remove()


def test_a_missing_base_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"rollout.server.transfer_dir {tmp_path / 'nope'} does not exist"):
        check_transfer_base(tmp_path / "nope")


def test_chunks_never_go_through_a_name_already_in_the_directory(tmp_path):
    """O_EXCL | O_NOFOLLOW: a planted link or file with a chunk's name is refused, its target untouched."""
    target = tmp_path / "target"
    target.write_bytes(b"precious")
    directory = tmp_path / "chunks"
    directory.mkdir(mode=0o700)
    (directory / "chunk-0.bin").symlink_to(target)
    assert os.path.realpath(directory / "chunk-0.bin") == str(target)  # a write by path would land there
    with pytest.raises(FileExistsError):
        list(write_chunks(WEIGHTS, directory))
    (directory / "chunk-0.bin").unlink()
    (directory / "chunk-0.bin").write_bytes(b"")
    with ChunkDirectory(directory) as opened, pytest.raises(FileExistsError):
        opened.create("chunk-0.bin")
    assert target.read_bytes() == b"precious"


def test_a_base_owned_by_another_user_is_refused(other_user, shared_scratch):
    """Its owner may rename anything in it, sticky or not."""
    base = shared_scratch / "theirs"
    base.mkdir(mode=0o755)
    os.chown(base, other_user.uid, other_user.gid)
    with pytest.raises(UnsafeTransferDirectory, match=f"owned by uid {other_user.uid}, not by this user"):
        TransferDirectory(base)
    # The control: its mode alone passes, so a check of the mode bits only would have taken it.
    assert not _mode(base) & (stat.S_IWGRP | stat.S_IWOTH)


def test_a_directory_swapped_by_another_user_is_never_written_through(other_user, shared_scratch):
    """The attack: the base (``rollout.server.transfer_dir``, root's, 0755: it passes the checks) sits in a directory
    another user owns; that user renames the base away and plants one of the same name holding a directory of the
    run's name with a link to a root-owned file. The next write goes into the run's real directory, through its
    descriptor; the swap is named before a push; the linked file keeps its bytes."""
    parent = shared_scratch / "project"
    parent.mkdir(mode=0o755)
    os.chown(parent, other_user.uid, other_user.gid)
    base = parent / "weights"
    base.mkdir(mode=0o755)
    victim = shared_scratch / "victim"
    victim.write_bytes(b"root's file")
    directory = TransferDirectory(base)
    try:
        list(write_chunks(WEIGHTS, directory))
        directory.check_in_place()
        directory.clear()
        swapped = other_user.run(
            f"""
parent, name, victim = {str(parent)!r}, {directory.name!r}, {str(victim)!r}
os.rename(parent + "/weights", parent + "/weights-moved")
os.makedirs(parent + "/weights/" + name)
os.symlink(victim, parent + "/weights/" + name + "/chunk-0.bin")
print(json.dumps({{"renamed": os.path.isdir(parent + "/weights-moved/" + name)}}))
"""
        )
        # The control: the attacker could rename the base, and a write by path would now follow the planted link.
        assert swapped == {"renamed": True}
        assert os.path.realpath(directory.path / "chunk-0.bin") == str(victim)
        with pytest.raises(UnsafeTransferDirectory, match=f"{directory.path} was replaced since the run created it"):
            directory.check_in_place()
        (info,) = write_chunks(WEIGHTS, directory)  # by descriptor: into the real directory, now renamed
        assert (parent / "weights-moved" / directory.name / info["file"]).stat().st_size == 40
        assert victim.read_bytes() == b"root's file"
    finally:
        directory.remove()
    assert (parent / "weights" / directory.name).is_dir()  # the planted directory is left to its owner


def test_a_process_that_ends_without_closing_leaves_no_directory(tmp_path):
    """A run that stops on an error may never close its engine: the directory (on /dev/shm: memory) goes at exit."""
    import subprocess
    import sys

    code = (
        "import sys; from stare_lightning.rollout.transfer_dir import TransferDirectory; "
        "d = TransferDirectory(sys.argv[1]); print(d.path); raise SystemExit(3)"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3 and done.stdout.strip().startswith(str(tmp_path))
    assert list(tmp_path.iterdir()) == []
