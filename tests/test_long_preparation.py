"""Long preparation announces itself: one line before it starts (what, about how long, where it is cached), then
progress at least every ``console.PROGRESS_EVERY_S`` seconds, reaching the terminal even while native output goes
to the run's log."""

from __future__ import annotations

import os
import re
import time

from stare_lightning import console
from stare_lightning.models.cold_start import TOKENS_PER_SECOND, expected_seconds, supervised_fine_tune


def test_a_long_preparation_is_announced_and_reports_while_it_runs(capfd, monkeypatch, tmp_path):
    monkeypatch.setattr(console, "PROGRESS_EVERY_S", 0.1)
    monkeypatch.setattr(console, "_log_file", tmp_path / "run.log")  # as in a run: native output diverted
    with console.long_preparation("model", "converting X", expected="about 1 s", cached_in=tmp_path / "x"):
        with console.native_output_to_log():
            os.write(2, b"a third-party progress bar\n")  # what tqdm writes to the process's stderr
            time.sleep(0.55)
    captured = capfd.readouterr()
    out = captured.out.splitlines()
    assert out[0] == f"[model] converting X: about 1 s; cached in {tmp_path / 'x'}, so it runs once"
    beats = [line for line in out if line.startswith("[model] still preparing (")]
    assert 3 <= len(beats) <= 6, out  # one every 0.1 s of the 0.55 s (a loaded machine may miss a few)
    assert re.fullmatch(r"\[model\] ready in \d+ s", out[-1]), out
    assert "a third-party progress bar" not in captured.out + captured.err
    assert "a third-party progress bar" in (tmp_path / "run.log").read_text()


def test_a_warm_up_reports_its_step_by_time_and_what_is_left(capsys, tiny_dir, tmp_path):
    examples = [("1 2 3 -> 6:", "1+2+3"), ("2 2 -> 4:", "2*2")]
    supervised_fine_tune(
        tiny_dir, tmp_path / "out", examples, steps=3, batch_size=2, lr=1e-3, seed=0, report_every_s=1e-9
    )
    lines = capsys.readouterr().out.splitlines()
    assert [re.match(r"\[cold start\] step (\d)/3, loss \d+\.\d{3}, \d+ s so far", line)[1] for line in lines] == [
        "1",
        "2",
        "3",
    ]
    assert "to go" in lines[0] and "to go" not in lines[-1]
    assert (tmp_path / "out" / "config.json").is_file()
    quiet = supervised_fine_tune(
        tiny_dir, tmp_path / "quiet", examples, steps=2, batch_size=2, lr=1e-3, seed=0, report_every_s=0
    )
    assert quiet.is_dir() and capsys.readouterr().out == ""


def test_the_expected_duration_counts_the_tokens_of_the_examples():
    examples = [("ab", "c"), ("abcd", "e")]  # 5 and 7 tokens with BOS and EOS: 6 on average
    assert expected_seconds(examples, steps=10, batch_size=4) == 10 * 4 * 6 / TOKENS_PER_SECOND
    assert console.minutes(40) == "40 s" and console.minutes(180) == "3 min" and console.minutes(3900) == "1 h 5 min"


def test_a_stdout_without_a_descriptor_gets_the_lines_itself(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(console, "PROGRESS_EVERY_S", 0.05)
    with console.long_preparation("model", "converting X", expected="about 1 s", cached_in=tmp_path):
        time.sleep(0.2)  # capsys's stdout has no file descriptor, as a notebook's
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("[model] converting X") and any("still preparing" in line for line in lines)
