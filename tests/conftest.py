import os

# Keep test processes off the hub and keep vLLM in-process, whatever the caller's environment says.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import pytest


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory):
    """One model cache for the whole session, so the tiny model's cold start runs once per settings."""
    path = os.environ.get("STARE_LIGHTNING_TEST_CACHE") or str(tmp_path_factory.mktemp("model_cache"))
    os.environ["STARE_LIGHTNING_CACHE"] = path
    return path


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """The built-in tiny model, randomly initialised (seed 0): for tests that must not depend on training."""
    from stare_lightning.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny", seed=0)
