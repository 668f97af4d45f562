"""A run's output folder against another local user (``run_folder.py``): a folder they made first, with links where
the run writes its credential and its servers' logs, is refused by ``serve`` and by the launcher in one line with
nothing written (the control: a write by path, as the launcher did, goes through the link); a folder others may write
is refused unless sticky; in a sticky one, their links and files are never written through, and the run's own
files are created 0600 by descriptor."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from stare_lightning.run_folder import RunFolder, UnsafeRunFolder
from tests import forked_cli

TOKEN = "test-token-" + "0123456789" * 3
ROOTS_ONLY = "a file only root may write\n"

# The attacker's preparation: the run folder first, mode 0777, with links where the run writes.
_PLANT = """
run = {run!r}
os.mkdir(run); os.chmod(run, 0o777)
os.symlink({token_target!r}, run + "/server-token")
os.mkdir(run + "/servers"); os.chmod(run + "/servers", 0o777)
os.symlink({log_target!r}, run + "/servers/server-0.log")
print(json.dumps({{"planted": sorted(os.listdir(run))}}))
"""


def _targets(scratch: Path) -> tuple[Path, Path]:
    targets = scratch / "token-target", scratch / "log-target"
    for target in targets:
        target.write_text(ROOTS_ONLY)
        target.chmod(0o600)
    return targets


def _entries(folder: Path) -> dict[str, str]:
    return {str(path.relative_to(folder)): os.readlink(path) if path.is_symlink() else "" for path in folder.rglob("*")}


def test_a_run_folder_another_user_made_first_is_refused_with_nothing_written(
    other_user, shared_scratch, tiny_dir, tmp_path
):
    from stare_lightning.rollout.server.trainer_side.launch import LaunchedServers, ServerSpec

    shared_scratch.chmod(0o777)  # where the other user may make the folder
    token_target, log_target = _targets(shared_scratch)
    run = shared_scratch / "run"
    other_user.run(_PLANT.format(run=str(run), token_target=str(token_target), log_target=str(log_target)))
    before = _entries(run)
    # serve, as a user starts it: one line, exit status 2, before anything is prepared or written.
    serve = forked_cli.run(["serve", "rollout=server", f"output_dir={run}"], cwd=tmp_path, timeout=300)
    errors = [line for line in serve.stderr.splitlines() if line.startswith("error:")]
    assert serve.returncode == 2 and len(errors) == 1, serve.stderr[-2000:]
    assert f"output_dir {run} is owned by uid {other_user.uid}" in errors[0]
    # A fit's launcher (logs in <output_dir>/servers): refused before any server starts.
    socket = str(shared_scratch / "0.sock")
    launched = LaunchedServers(tiny_dir, [ServerSpec(0, uds=socket)], log_dir=run / "servers", token=TOKEN)
    with pytest.raises(UnsafeRunFolder, match=f"is owned by uid {other_user.uid}"):
        launched.start()
    assert not launched._processes and not (shared_scratch / "0.sock").exists()
    assert _entries(run) == before
    assert token_target.read_text() == log_target.read_text() == ROOTS_ONLY
    # The control: the launcher's earlier open, by path, appends to root's file through the attacker's link.
    with open(run / "servers" / "server-0.log", "ab") as log:
        log.write(b"# rollout server\n")
    assert log_target.read_text() != ROOTS_ONLY


WRITABLE = [(0o777, "its group and other users"), (0o775, "its group"), (0o1777, None), (0o755, None)]


@pytest.mark.parametrize(("mode", "refused"), WRITABLE)
def test_a_run_folder_others_may_write_is_refused_unless_sticky(tmp_path, mode, refused):
    folder = tmp_path / "run"
    folder.mkdir()
    folder.chmod(mode)
    if refused is None:  # the control: a folder only its owner may write, or a sticky one
        with RunFolder(folder) as run:
            assert run.write_private("server-token", TOKEN) == folder / "server-token"
        assert stat.S_IMODE((folder / "server-token").stat().st_mode) == 0o600
        return
    with pytest.raises(UnsafeRunFolder, match=f"writable by {refused} \\(mode {mode:04o}\\) and not sticky"):
        RunFolder(folder)
    assert not list(folder.iterdir())


def test_links_and_files_of_another_user_in_a_sticky_run_folder_are_never_written_through(other_user, shared_scratch):
    token_target, log_target = _targets(shared_scratch)
    run = shared_scratch / "sticky"
    run.mkdir()
    run.chmod(0o1777)  # as /tmp: anyone may add an entry, only its owner may remove or rename it
    other_user.run(
        f"os.symlink({str(log_target)!r}, {str(run / 'server-0.log')!r}); "
        f"os.symlink({str(shared_scratch)!r}, {str(run / 'servers')!r}); "
        f"open({str(run / 'server-1.log')!r}, 'w').close(); print(json.dumps({{}}))"
    )
    with RunFolder(run) as folder:
        with pytest.raises(UnsafeRunFolder, match="server-0.log cannot be opened as this run's file"):
            folder.append("server-0.log")
        with pytest.raises(UnsafeRunFolder, match=f"server-1.log is owned by uid {other_user.uid}"):
            folder.append("server-1.log")
        with pytest.raises(UnsafeRunFolder, match="servers is not a folder of this run"):
            folder.folder("servers")
        # The control: a name of the run's own is created, and appended to, by descriptor.
        for text in (b"one\n", b"two\n"):
            with folder.append("server-2.log") as log:
                log.write(text)
    assert (run / "server-2.log").read_bytes() == b"one\ntwo\n"
    assert log_target.read_text() == ROOTS_ONLY and (run / "server-1.log").read_text() == ""


def test_the_credential_replaces_a_link_at_its_name_and_never_writes_through_it(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text(ROOTS_ONLY)
    run = tmp_path / "run"
    run.mkdir()
    (run / "server-token").symlink_to(target)
    with RunFolder(run) as folder:
        folder.write_private("server-token", TOKEN)
    written = run / "server-token"
    assert not written.is_symlink() and written.read_text() == TOKEN + "\n"
    assert stat.S_IMODE(written.stat().st_mode) == 0o600 and target.read_text() == ROOTS_ONLY
    assert sorted(path.name for path in run.iterdir()) == ["server-token"]  # no temporary file left
