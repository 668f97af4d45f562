import os

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


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Under ``--dist loadgroup`` every test marked ``xdist_group`` must carry its group in its node id (pytest-xdist
    adds it); if it does not, the group's tests would be split across workers and each would repeat the group's
    expensive setup (a cold start, an engine), so stop before anything runs."""
    if not os.environ.get("PYTEST_XDIST_WORKER") or not getattr(config.option, "loadgroup", False):
        return
    split = [item.nodeid for item in items if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
    if split:
        raise pytest.UsageError(
            f"pytest-xdist did not tag {len(split)} xdist_group tests (e.g. {split[0]}) with their group: this "
            "pytest is too new for the installed pytest-xdist; install the dev extra's pins (pip install -e '.[dev]')"
        )


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory):
    """One model cache for the whole session, shared by the xdist workers (a warm-up is cached under a file lock,
    so each cold start runs once per settings whichever worker asks first)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path = os.environ.get("STARE_LIGHTNING_TEST_CACHE") or str(shared / "model_cache")
    os.makedirs(path, exist_ok=True)
    os.environ["STARE_LIGHTNING_CACHE"] = path
    return path


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """The built-in tiny model, randomly initialised (seed 0): for tests that must not depend on training."""
    from stare_lightning.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny", seed=0)
