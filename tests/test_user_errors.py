"""Errors a user causes print one line, ``error: <what> (<where>)``, and exit with status 2; bugs keep their
traceback. The command line is what is tested, so each case runs ``python -m stare_lightning`` (in parallel)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stare_lightning.user_errors import one_line, reported
from tests import forked_cli

REPO = Path(__file__).resolve().parents[1]


def test_reported_turns_a_user_error_into_one_line_and_status_2(capsys):
    def bad_value():
        raise ValueError("data.train_files[0]='x.jsonl' does not exist\nset it to a JSONL file")

    with pytest.raises(SystemExit) as stop:
        reported(bad_value)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("error: data.train_files[0]='x.jsonl' does not exist; set it to a JSONL file (ValueError;")
    with pytest.raises(ValueError):
        reported(bad_value, verbose=True)
    with pytest.raises(ZeroDivisionError):  # a bug, not a bad input: the traceback stays
        reported(lambda: 1 / 0)
    assert (
        one_line(FileNotFoundError(2, "No such file or directory", "/x/y"))
        == "[Errno 2] No such file or directory: '/x/y'"
    )


@pytest.mark.slow
def test_each_kind_of_user_error_is_one_line_with_exit_status_2(tmp_path):
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text('{"prompt": "2+2?", "answer": "4", "verifier": "exact"}\n{"prompt": "x", "answer": \n')
    not_a_checkpoint = tmp_path / "last.ckpt"
    not_a_checkpoint.write_text("not a checkpoint")
    out = f"output_dir={tmp_path / 'run'}"
    hf = f"export_dir={tmp_path / 'hf'}"
    cases = {
        "config value": (["fit", "algorithm.stare.top_ratio=3", out], "algorithm.stare.top_ratio"),
        "config key": (["fit", "algorithm.no_such_key=1", out], "algorithm.no_such_key"),
        "config group": (["fit", "model=no_such_model", out], "model/no_such_model"),
        "data file": (["fit", "data.task=null", f"data.train_files=[{bad_jsonl}]", out], f"{bad_jsonl}, line 2"),
        "model path": (["fit", "model=hf", "model.name_or_path=/no/such/model", out], "/no/such/model"),
        "checkpoint": (["export", f"ckpt_path={not_a_checkpoint}", hf, out], "last.ckpt"),
        "missing checkpoint": (["export", f"ckpt_path={tmp_path / 'none.ckpt'}", hf, out], "none.ckpt"),
    }
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "STARE_LIGHTNING_CACHE": str(tmp_path / "cache")}
    env.pop("HYDRA_FULL_ERROR", None)
    procs = {
        name: forked_cli.ForkedCommand(args, cwd=tmp_path, env=env, separate_stderr=True)
        for name, (args, _) in cases.items()
    }
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert proc.returncode == 2, (name, stderr[-3000:])
        assert len(lines) == 1 and lines[0].startswith("error: "), (name, stderr[-3000:])
        assert cases[name][1] in lines[0], (name, lines[0])
        assert "Traceback" not in stdout + stderr, name


# What gloo raised on a rank whose peer was killed mid all-reduce (seen on the test cluster), and errors that are not.
GLOO_PEER_GONE = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[10.215.0.2]:36738. This is typically caused by a remote worker crashing."
)


def test_a_rank_whose_peer_is_gone_says_so_in_one_line(capsys):
    from stare_lightning.user_errors import lost_peer, reported

    def fail(error):
        raise error

    with pytest.raises(SystemExit) as ended:
        reported(lambda: fail(RuntimeError(GLOO_PEER_GONE)))
    assert ended.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: another rank of this run ended or cannot be reached (") and "\n" not in err
    assert "Connection closed by peer [10.215.0.2]:36738" in err and "typically" not in err
    # The controls: a bug's RuntimeError keeps its traceback, and so does one that only mentions a peer.
    assert not lost_peer(RuntimeError("shape mismatch")) and not lost_peer(RuntimeError("peer review"))
    with pytest.raises(RuntimeError, match="shape mismatch"):
        reported(lambda: fail(RuntimeError("shape mismatch")))
