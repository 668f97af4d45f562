"""Errors a user causes (a config value, a data file, a path, a checkpoint) as one line, not a traceback.

``python -m stare_lightning`` runs each subcommand through ``reported``: an exception of ``USER_ERRORS`` prints
``error: <what> (<where>)`` on stderr and exits with status 2; its traceback goes to the run's log file (Hydra's
``<output_dir>/<job>.log``) and the line says where. The messages themselves name the file, line, key and allowed
values (the schema's and the readers' checks are written that way). ``verbose=true`` or ``HYDRA_FULL_ERROR=1``
shows the traceback instead, and any other exception, a bug rather than a bad input, always keeps it.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["USER_ERRORS", "is_verbose", "one_line", "reported"]

T = TypeVar("T")


def _user_error_types() -> tuple[type[BaseException], ...]:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    # ValueError: the schema's and the readers' checks (omegaconf's ValidationError is one too); OSError: missing
    # files and directories, unreadable checkpoints, a full disk; Hydra's and OmegaConf's own: overrides and keys.
    return (ValueError, OSError, HydraException, OmegaConfBaseException)


USER_ERRORS: tuple[type[BaseException], ...] = _user_error_types()


def one_line(error: BaseException) -> str:
    """The error's message on one line (a multi-line message joined with '; ')."""
    text = str(error).strip() or type(error).__name__
    if isinstance(error, OSError) and error.filename and str(error.filename) not in text:
        text = f"{text} ({error.filename})"
    text = text.split("Config search path:", 1)[0]  # Hydra's list of search providers: noise to a user
    joined = ""
    for line in (line.strip() for line in text.splitlines()):
        if line:
            joined += line if not joined else (" " if joined.endswith((".", ":", ";")) else "; ") + line
    return joined


def _log_files() -> list[str]:
    return [h.baseFilename for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]


def _write_traceback(error: BaseException, files: list[str]) -> None:
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    for path in files:
        with open(path, "a") as log:
            log.write(f"[stare_lightning][ERROR] - {one_line(error)}\n{text}")


def lost_peer(error: BaseException) -> bool:
    """A collective that failed because another rank is gone (gloo's transport errors: a closed or reset connection,
    a timeout): that rank's own error says what happened, and this rank's traceback adds nothing."""
    text = str(error)
    return isinstance(error, RuntimeError) and "gloo/transport" in text and ("peer" in text or "Timed out" in text)


def reported(action: Callable[[], T], *, verbose: bool = False) -> T:
    """``action()``, with a user error turned into one line on stderr and exit status 2 (see the module docstring),
    and a rank whose peer is gone (``lost_peer``) into one line and status 1."""
    try:
        return action()
    except BaseException as error:
        lost = lost_peer(error)
        if not (lost or isinstance(error, USER_ERRORS)) or verbose or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        files = _log_files()
        _write_traceback(error, files)
        where = f"; traceback in {files[0]}" if files else "; verbose=true shows the traceback"
        if lost:
            first = one_line(error).split(" This is typically", 1)[0]
            print(
                f"error: another rank of this run ended or cannot be reached ({first}); its own output says why "
                f"(RuntimeError{where})",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(1) from None
        print(f"error: {one_line(error)} ({type(error).__name__}{where})", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def is_verbose(cfg: Any) -> bool:
    try:
        return bool(cfg.get("verbose", False))
    except Exception:  # noqa: BLE001 - a config too broken to read: the error itself will say why
        return False
