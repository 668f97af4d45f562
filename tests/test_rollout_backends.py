"""The rollout backends' registry: every entry builds through an importable function, a new entry is one
registration away, and what a run may set follows what its backend declares, not its name."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from stare_lightning.rollout import backends
from stare_lightning.rollout.backends import ROLLOUT_BACKENDS, RolloutBackend, register_rollout_backend
from stare_lightning.rollout.config import RolloutConfig


@pytest.fixture
def registry():
    """Registrations made by a test are undone after it."""
    saved = dict(ROLLOUT_BACKENDS)
    yield ROLLOUT_BACKENDS
    ROLLOUT_BACKENDS.clear()
    ROLLOUT_BACKENDS.update(saved)


def test_every_backend_builder_and_preflight_is_importable():
    assert set(ROLLOUT_BACKENDS) == {"vllm", "hf", "server"}
    for backend in ROLLOUT_BACKENDS.values():
        assert callable(backends._load(backend.builder, backend.name))
        if backend.preflight is not None:
            assert callable(backends._load(backend.preflight, backend.name))


def test_the_registry_loads_no_engine_and_no_torch():
    code = "import sys, stare_lightning.rollout.config; print(sorted(m for m in sys.modules if m.split('.')[0] in " \
           "('torch', 'vllm', 'transformers')))"  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize(
    "name, builder, message",
    [
        ("auto", "m:f", "not allowed"),
        ("two words", "m:f", "not allowed"),
        ("mine", "no_colon", "must be 'module:function'"),
        ("hf", "m:f", "registered already"),
    ],
)
def test_registration_refuses_bad_entries(registry, name, builder, message):
    with pytest.raises(ValueError, match=message):
        register_rollout_backend(RolloutBackend(name=name, builder=builder, summary=""))


def test_a_registered_backend_is_a_choice_and_its_capabilities_decide_the_checks(registry):
    with pytest.raises(ValueError, match="rollout.backend='mine' is not allowed"):
        RolloutConfig(backend="mine")
    colocated = register_rollout_backend(RolloutBackend(name="mine", builder="m:f", summary="a test backend"))
    assert RolloutConfig(backend="mine").backend == "mine"
    with pytest.raises(ValueError, match="rollout.max_staleness=1 does nothing with rollout.backend=mine"):
        RolloutConfig(backend="mine", max_staleness=1)
    with pytest.raises(ValueError, match="not allowed with rollout.backend=mine"):
        RolloutConfig(backend="mine", engine_kwargs={"max_num_seqs": 8})
    with pytest.raises(ValueError, match="rollout.gpu_memory_utilization does nothing with rollout.backend=mine"):
        RolloutConfig(backend="mine", gpu_memory_utilization=0.5)
    with pytest.raises(ValueError, match="rollout.server settings do nothing with rollout.backend=mine"):
        RolloutConfig(backend="mine", server={"count": 2})
    # The same name, declared served, in-process sizing and engine arguments: the same settings now pass.
    register_rollout_backend(
        dataclasses.replace(colocated, served=True, in_process_memory=True, engine_kwargs=True), replace=True
    )
    config = RolloutConfig(backend="mine", max_staleness=1, engine_kwargs={"max_num_seqs": 8}, tensor_parallel_size=2)
    assert config.max_staleness == 1 and config.engine_kwargs == {"max_num_seqs": 8}


def test_a_builder_that_cannot_be_imported_is_named(registry):
    backend = register_rollout_backend(RolloutBackend(name="broken", builder="no_such_module:build", summary=""))
    with pytest.raises(ImportError, match="rollout backend 'broken'.s builder 'no_such_module:build' cannot be"):
        backend.build(RolloutConfig(), None)


def test_a_backend_without_tool_episodes_or_lora_refuses_them(registry, tmp_path):
    from stare_lightning.cli import compose, prepare_config

    register_rollout_backend(RolloutBackend(name="plain", builder="m:f", summary="", tool_episodes=False, lora=False))

    def run(*overrides):
        return prepare_config(compose([f"output_dir={tmp_path}", "rollout.backend=plain", *overrides]))

    run()  # neither asked for: accepted
    with pytest.raises(ValueError, match="tools=calculator needs a rollout backend that runs tool episodes"):
        run("tools=calculator")
    with pytest.raises(ValueError, match="model.lora.rank=4 needs a rollout backend that takes"):
        run("model.lora.rank=4")
