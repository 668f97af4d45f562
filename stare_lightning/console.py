"""What a run prints: this project's lines, every error, the progress bar and the summary table.

Third-party notices (vLLM's engine warnings, Lightning's tips and deprecations, transformers' loading bars,
warnings raised inside other packages) go to the run's log file instead, unless ``verbose=true``. Three
channels carry them, and each is routed on its own:

- Python logging: vLLM is told not to install its own stdout handler and Lightning's handler is removed,
  so their records reach the root logger, whose file handler keeps everything and whose console handlers
  drop records of other packages below ERROR.
- ``warnings``: captured into logging ("py.warnings"); on the console only those raised from this
  project's own source files are shown.
- Native output (C++ notices from torch, progress bars written during vLLM's engine start):
  ``native_output_to_log`` points file descriptors 1 and 2 at the log file while such code runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["configure", "long_preparation", "minutes", "native_output_to_log", "ThirdPartyFilter"]

PROGRESS_EVERY_S = 30.0  # the longest a long preparation stays silent

_PROJECT_DIR = f"{os.sep}stare_lightning{os.sep}"
_OWN_LOGGERS = ("stare_lightning", "__main__", "hydra")
_HANDLER_OWNERS = ("lightning", "lightning.pytorch", "lightning.fabric", "vllm")  # loggers that print on their own
_log_file: Path | None = None  # set by `configure` when third-party output is diverted


class ThirdPartyFilter(logging.Filter):
    """Keeps errors, this project's records and warnings raised from this project's source files."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        if record.name == "py.warnings":
            return _PROJECT_DIR in record.getMessage().split(":", 1)[0]
        return record.name.split(".", 1)[0] in _OWN_LOGGERS


def configure(*, verbose: bool, output_dir: str | os.PathLike) -> Path | None:
    """Route third-party output as the module docstring says; returns the log file (None when verbose).

    Call before vLLM is imported (its logging is configured at import). The log file is the root logger's
    file handler (Hydra's ``<output_dir>/<job>.log``), or ``<output_dir>/stare_lightning.log`` without one.
    """
    global _log_file
    # Before the first write into it: a folder another user owns or may write is refused (run_folder.py).
    from stare_lightning.run_folder import RunFolder

    RunFolder(output_dir).close()
    if verbose:
        _log_file = None
        return None
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    root = logging.getLogger()
    files = [h for h in root.handlers if isinstance(h, logging.FileHandler)]
    if not files:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(Path(output_dir) / "stare_lightning.log")
        handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
        root.addHandler(handler)
        files = [handler]
    if root.level > logging.INFO or root.level == logging.NOTSET:
        root.setLevel(logging.INFO)
    for handler in root.handlers:
        if not isinstance(handler, logging.FileHandler) and not any(
            isinstance(f, ThirdPartyFilter) for f in handler.filters
        ):
            handler.addFilter(ThirdPartyFilter())
    if not any(isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler) for h in root.handlers):
        console = logging.StreamHandler(sys.stderr)  # without Hydra: this project's lines still reach the terminal
        console.addFilter(ThirdPartyFilter())
        console.setLevel(logging.INFO)
        root.addHandler(console)
    import lightning  # noqa: F401  (its import adds handlers to these loggers: import first, then remove them)

    for name in _HANDLER_OWNERS:
        owned = logging.getLogger(name)
        for handler in list(owned.handlers):
            owned.removeHandler(handler)
        owned.propagate = True
    logging.captureWarnings(True)
    try:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    except ImportError:  # transformers is a dependency; only a broken install lands here
        pass
    _log_file = Path(files[0].baseFilename)
    return _log_file


@contextlib.contextmanager
def native_output_to_log() -> Iterator[None]:
    """While inside, file descriptors 1 and 2 write to the log file (a no-op unless ``configure`` diverted)."""
    if _log_file is None:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(_log_file, "ab", buffering=0) as log:
        try:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def minutes(seconds: float) -> str:
    """A duration as a person reads it: ``40 s``, ``3 min``, ``1 h 5 min``."""
    if seconds < 90:
        return f"{max(seconds, 1):.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds // 3600:.0f} h {seconds % 3600 / 60:.0f} min"


@contextlib.contextmanager
def long_preparation(tag: str, what: str, *, expected: str, cached_in: str | os.PathLike) -> Iterator[None]:
    """Announce a preparation that takes long (a model conversion, a warm-up) before it starts: what it is, about
    how long it takes and where its result is cached; then a line every ``PROGRESS_EVERY_S`` seconds while it runs,
    and one when it is done. The lines reach the terminal even while ``native_output_to_log`` diverts it."""
    print(f"[{tag}] {what}: {expected}; cached in {cached_in}, so it runs once", flush=True)
    try:  # the terminal itself, which native_output_to_log does not divert
        terminal = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    except (AttributeError, OSError, ValueError):  # a stdout without a descriptor (a notebook): write to it as it is
        terminal = None
    started, done = time.perf_counter(), threading.Event()

    def beat() -> None:
        while not done.wait(PROGRESS_EVERY_S):
            line = f"[{tag}] still preparing ({minutes(time.perf_counter() - started)} so far)"
            print(line, file=terminal or sys.stdout, flush=True)

    thread = threading.Thread(target=beat, name=f"{tag} progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        if terminal is not None:
            terminal.close()
    print(f"[{tag}] ready in {minutes(time.perf_counter() - started)}", flush=True)
