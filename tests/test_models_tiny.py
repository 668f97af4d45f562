"""The built-in tiny model: tokenizer round trip, HF loading, forward shapes, determinism."""

from __future__ import annotations

import json
import string

import pytest
import torch

from stare_lightning.models.tiny import BOS, EOS, PAD, build_tiny_model, tiny_vocab


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


def test_directory_is_a_standard_hf_checkpoint(tiny_dir):
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (tiny_dir / name).is_file(), name
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["hidden_size"] // config["num_attention_heads"] == 32  # vLLM's CPU attention needs >= 32
    gen = json.loads((tiny_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tiny_vocab()[EOS]


@pytest.mark.parametrize(
    "text",
    [
        "",
        "a",
        "Hello, world!",
        "  two  spaces  ",
        "tabs\tand\nnew\r\nlines",
        string.printable,
        "x = 3 * (4 + 5) // 2 ~ {}",
    ],
)
def test_round_trip(tokenizer, text):
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id
    assert len(ids) == len(text) + 1  # one token per character
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_special_tokens(tokenizer):
    vocab = tiny_vocab()
    assert tokenizer.bos_token == BOS and tokenizer.bos_token_id == vocab[BOS]
    assert tokenizer.eos_token == EOS and tokenizer.eos_token_id == vocab[EOS]
    assert tokenizer.pad_token == PAD and tokenizer.pad_token_id == vocab[PAD]
    assert tokenizer.unk_token_id is not None
    assert tokenizer.encode("é") == [tokenizer.bos_token_id, tokenizer.unk_token_id]
    ids = tokenizer.encode("ab") + [tokenizer.eos_token_id]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "ab"
    assert tokenizer.decode(ids) == "<bos>ab<eos>"


def test_left_padding(tokenizer):
    batch = tokenizer(["ab", "abcd"], padding=True)
    assert batch["input_ids"][0][:2] == [tokenizer.pad_token_id] * 2
    assert batch["attention_mask"][0] == [0, 0, 1, 1, 1]


def test_hf_load_and_forward_shapes(tiny_dir, tokenizer):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert isinstance(model, LlamaForCausalLM)
    assert model.dtype == torch.float32
    assert model.config.vocab_size == len(tokenizer)
    assert not model.config.tie_word_embeddings
    batch = tokenizer(["hi", "hello"], padding=True, return_tensors="pt")
    logits = model(**batch).logits
    assert logits.shape == (2, batch["input_ids"].shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()


def test_seeded_build_is_deterministic_and_leaves_global_rng(tmp_path):
    from safetensors.torch import load_file

    state = torch.get_rng_state()
    a = load_file(build_tiny_model(tmp_path / "a", seed=3) / "model.safetensors")
    b = load_file(build_tiny_model(tmp_path / "b", seed=3) / "model.safetensors")
    c = load_file(build_tiny_model(tmp_path / "c", seed=4) / "model.safetensors")
    assert torch.equal(state, torch.get_rng_state())
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
