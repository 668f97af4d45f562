"""The test session's ground rules: threads, offline hubs, caches under a session directory, what a test needs from
the machine (tests/needs.py), and a final check that the session left nothing in the checkout."""

import os
import subprocess
from pathlib import Path

# Under pytest-xdist (`make test`: two workers on two cores) each worker computes on one thread: two single-thread
# processes run side by side at full speed, two processes of two threads each fight over the cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(_variable, "1")

# Keep test processes off the hub and keep vLLM in-process, whatever the caller's environment says.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import pytest

from tests import forked_cli
from tests.needs import require

# Fixtures shared by the test modules that play a second local user (other_user, shared_scratch).
pytest_plugins = ("tests.other_user",)

REPO = Path(__file__).resolve().parents[1]

# Caches and state that tests and the processes they start would otherwise write under the home directory or /tmp.
# They go under the session's directory instead (set before anything imports vLLM, torch's compiler or matplotlib).
CACHE_VARIABLES = {
    "XDG_CACHE_HOME": "xdg_cache",  # Hugging Face (datasets), pip, and what else follows the XDG layout
    "VLLM_CACHE_ROOT": "vllm",  # vLLM's torch.compile artefacts
    "TORCHINDUCTOR_CACHE_DIR": "torchinductor",
    "TRITON_CACHE_DIR": "triton",
    "MPLCONFIGDIR": "matplotlib",
    "IPYTHONDIR": "ipython",  # the notebook tests' kernels: profile and history
}
# Directories the checkout may gain without a test having written them: the environment, bytecode, pytest's own
# cache, and ruff's (`make test` lints first).
OWN_LITTER = {".venv", "__pycache__", ".pytest_cache", ".ruff_cache"}
_CHECKOUT_BEFORE = pytest.StashKey[dict]()


def _is_controller(config) -> bool:
    """The process that runs the session: the only one without xdist's ``workerinput``."""
    return not hasattr(config, "workerinput")


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    if not _is_controller(config):
        return  # the workers inherit the controller's environment, caches included
    # The controller's base temporary directory: each xdist worker's lies inside it, so a cache here is shared by
    # the workers (builds are guarded by file locks) and goes away with pytest's other old temporary directories.
    session_dir = config._tmp_path_factory.getbasetemp()
    for variable, name in CACHE_VARIABLES.items():
        os.environ[variable] = str(session_dir / name)
    # The model cache (built-in models and their cold-start warm-ups); STARE_LIGHTNING_TEST_CACHE keeps one across
    # sessions for a developer who reruns a few tests.
    model_cache = os.environ.get("STARE_LIGHTNING_TEST_CACHE") or str(session_dir / "model_cache")
    os.makedirs(model_cache, exist_ok=True)
    os.environ["STARE_LIGHTNING_CACHE"] = model_cache
    config.stash[_CHECKOUT_BEFORE] = _checkout_litter()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """``@pytest.mark.needs(...)`` and ``@pytest.mark.vllm``: checked before the test's fixtures start."""
    for mark in item.iter_markers("needs"):
        require(*mark.args)
    if item.get_closest_marker("vllm"):
        require("vllm")


def pytest_sessionfinish(session, exitstatus):
    """Fail the session when the checkout gained a file that is not tracked: every test writes under its tmp_path
    or the session directory, never into the checkout (not even into ignored places such as outputs/)."""
    config = session.config
    if not _is_controller(config) or _CHECKOUT_BEFORE not in config.stash:
        return
    before, after = config.stash[_CHECKOUT_BEFORE], _checkout_litter()
    if before is None or after is None:
        return  # not a git checkout (an unpacked source distribution, say): nothing to compare
    gained = sorted(set(after) - set(before))
    if not gained:
        return
    shown = "\n".join(f"  {path}" for path in gained[:20]) + (f"\n  ... {len(gained) - 20} more" if gained[20:] else "")
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    files = f"{len(gained)} file" + ("s" if len(gained) > 1 else "")
    message = f"the tests left {files} in the checkout {REPO} (write under tmp_path instead):\n{shown}"
    if reporter is not None:
        reporter.ensure_newline()
        reporter.write_line(message, red=True, bold=True)
    else:
        print(message)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _checkout_litter() -> list[str] | None:
    """Every untracked file of the checkout that holds these tests, ignored ones included (an ignored directory
    is listed file by file, so a run folder added under an existing outputs/ counts too), but for ``OWN_LITTER``;
    None when the tests do not sit at the top of a git checkout."""
    top = _git("rev-parse", "--show-toplevel")
    if top is None or Path(top.strip()).resolve() != REPO:
        return None
    untracked = _git("status", "--porcelain", "-z", "--untracked-files=all")
    ignored = _git("status", "--porcelain", "-z", "--ignored", "--untracked-files=normal")
    if untracked is None or ignored is None:
        return None
    found = [entry[3:] for entry in untracked.split("\0") if entry.startswith("?? ")]
    for entry in ignored.split("\0"):
        if not entry.startswith("!! "):
            continue
        path = entry[3:]
        if OWN_LITTER & set(Path(path).parts):
            continue
        if not path.endswith("/"):
            found.append(path)
            continue
        for folder, subfolders, files in os.walk(REPO / path):
            subfolders[:] = [name for name in subfolders if name not in OWN_LITTER]
            found.extend(str(Path(folder, name).relative_to(REPO)) for name in files)
    return found


@pytest.fixture(scope="session")
def model_cache():
    """The session's model cache (pytest_configure above), shared by the xdist workers: a warm-up is cached under a
    file lock, so each cold start runs once per settings whichever worker asks first."""
    return os.environ["STARE_LIGHTNING_CACHE"]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """The built-in tiny model, randomly initialised (seed 0): for tests that must not depend on training."""
    from stare_lightning.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny", seed=0)


def pytest_itemcollected(item):
    """A test that needs the vLLM engine starts one, in process or as a server: an end-to-end test, so ``slow`` too
    (``make test-fast`` leaves it out), whether or not it says so itself."""
    if item.get_closest_marker("vllm") and not item.get_closest_marker("slow"):
        item.add_marker(pytest.mark.slow)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Under ``--dist loadgroup`` every test marked ``xdist_group`` must carry its group in its node id (pytest-xdist
    adds it); if it does not, the group's tests would be split across workers and each would repeat the group's
    expensive setup (a cold start, an engine), so stop before anything runs."""
    # Commands that sample with vLLM come from end-to-end tests only: without one (make test-fast), the forked-command
    # server does not import vLLM (about 4 s of CPU per test process).
    os.environ[forked_cli.VLLM_ENV] = "1" if any(item.get_closest_marker("slow") for item in items) else "0"
    if not os.environ.get("PYTEST_XDIST_WORKER") or not getattr(config.option, "loadgroup", False):
        return
    split = [item.nodeid for item in items if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
    if split:
        raise pytest.UsageError(
            f"pytest-xdist did not tag {len(split)} xdist_group tests (e.g. {split[0]}) with their group: this "
            "pytest is too new for the installed pytest-xdist; install the dev extra's pins (pip install -e '.[dev]')"
        )
