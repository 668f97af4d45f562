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
