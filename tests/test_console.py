"""Terminal output: third-party notices reach the log file only; this project's lines and every error reach both."""

from __future__ import annotations

import logging
import warnings

import pytest

from stare_lightning import console

EMITTERS = ("vllm.engine", "lightning.pytorch.utilities", "stare_lightning.train", "vllm.worker")


@pytest.fixture
def isolated_logging(tmp_path):
    """A root logger with one console and one file handler, as Hydra sets it up; restored afterwards."""
    root, vllm = logging.getLogger(), logging.getLogger("vllm")
    saved = (root.handlers[:], root.level, vllm.handlers[:])
    # As in a fresh run: a vLLM or TRL imported by another test of this worker may have set levels or disabled these.
    emitters = [logging.getLogger(name) for name in ("vllm", *EMITTERS)]
    states = [(logger.level, logger.disabled) for logger in emitters]
    for logger in emitters:
        logger.setLevel(logging.NOTSET)
        logger.disabled = False
    stream_path = tmp_path / "terminal.txt"
    stream = open(stream_path, "w")
    file_handler = logging.FileHandler(tmp_path / "run.log")
    root.handlers = [logging.StreamHandler(stream), file_handler]
    root.setLevel(logging.INFO)
    logging.getLogger("vllm").addHandler(logging.StreamHandler(stream))  # vLLM prints on its own
    yield stream_path, tmp_path / "run.log", stream
    logging.captureWarnings(False)
    console._log_file = None
    stream.close()
    file_handler.close()
    root.handlers, root.level = saved[0], saved[1]
    vllm.handlers = saved[2]
    for logger, (level, disabled) in zip(emitters, states):
        logger.setLevel(level)
        logger.disabled = disabled


def emit_everything():
    logging.getLogger("vllm.engine").warning("engine notice")
    logging.getLogger("lightning.pytorch.utilities").info("GPU available: False")
    logging.getLogger("stare_lightning.train").info("project line")
    logging.getLogger("vllm.worker").error("engine error")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn_explicit("third-party deprecation", FutureWarning, "/x/site-packages/vllm/a.py", 3)
        warnings.warn_explicit("skipped step", RuntimeWarning, "/x/src/stare_lightning/module.py", 9)


@pytest.mark.parametrize("verbose", [False, True])
def test_third_party_notices_go_to_the_log_file_unless_verbose(isolated_logging, verbose):
    terminal, log_file, stream = isolated_logging
    returned = console.configure(verbose=verbose, output_dir=log_file.parent)
    emit_everything()
    stream.flush()
    shown, logged = terminal.read_text(), log_file.read_text()
    for line in ("project line", "engine error"):
        assert line in shown
    for notice in ("engine notice", "GPU available"):
        assert (notice in shown) is verbose
    if not verbose:  # (verbose leaves warnings to Python's own printing)
        assert "skipped step" in shown and "third-party deprecation" not in shown
        assert returned == log_file
        for line in ("engine notice", "GPU available", "third-party deprecation", "project line", "engine error"):
            assert line in logged


def test_native_output_goes_to_the_log_file(isolated_logging, capfd):
    import os

    _, log_file, _ = isolated_logging
    console.configure(verbose=False, output_dir=log_file.parent)
    with console.native_output_to_log():
        os.write(2, b"[W native notice]\n")
        os.write(1, b"native stdout\n")
    os.write(2, b"after\n")
    captured = capfd.readouterr()
    assert "native notice" not in captured.err and "native stdout" not in captured.out
    assert "after" in captured.err
    assert "[W native notice]" in log_file.read_text() and "native stdout" in log_file.read_text()
