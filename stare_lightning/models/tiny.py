"""The built-in tiny model: a random-init 2-layer Llama with a character-level tokenizer.

It exists so that every part of the framework (HF generate, vLLM on CPU, FSDP2 sharding, export) can be
exercised offline in seconds. Sizing follows what vLLM's CPU backend accepts: head_dim 32 (it refuses 16).
Every printable ASCII character is one token, so ``decode(encode(s), skip_special_tokens=True) == s`` for
any printable ASCII string; other characters map to ``<unk>``.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
# string.printable: digits, letters, punctuation, space, \t \n \r \x0b \x0c, in that order (fixed ids).
CHARACTERS = tuple(string.printable)

TINY_CONFIG = dict(
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,  # head_dim 32: vLLM's CPU attention refuses head_dim 16
    num_key_value_heads=4,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    initializer_range=0.02,
)


def tiny_vocab() -> dict[str, int]:
    """Token -> id: the four special tokens first, then one token per printable ASCII character."""
    tokens = list(SPECIAL_TOKENS) + list(CHARACTERS)
    return {tok: i for i, tok in enumerate(tokens)}


def build_tiny_tokenizer():
    """A ``PreTrainedTokenizerFast`` that splits text into single characters and prepends ``<bos>``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = tiny_vocab()
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # One pre-token per character, newlines included ([\s\S] matches any character).
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse joins the decoded tokens with nothing in between (WordLevel's default would insert spaces).
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A $B:1",
        special_tokens=[(BOS, vocab[BOS])],
    )
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        padding_side="left",
        model_max_length=TINY_CONFIG["max_position_embeddings"],
    )
    return tokenizer


def tiny_config(vocab_size: int):
    from transformers import LlamaConfig

    vocab = tiny_vocab()
    return LlamaConfig(
        vocab_size=vocab_size,
        bos_token_id=vocab[BOS],
        eos_token_id=vocab[EOS],
        pad_token_id=vocab[PAD],
        **TINY_CONFIG,
    )


def build_tiny_model(out_dir: str | Path, *, seed: int = 0) -> Path:
    """Build the tiny model and its tokenizer into ``out_dir`` (a standard HF directory) and return it.

    The weights depend only on ``seed``; the global torch RNG state is left untouched.
    """
    from transformers import GenerationConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer()
    config = tiny_config(len(tokenizer))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    portable_tokenizer_class(out)
    return out


def portable_tokenizer_class(out: Path) -> None:
    """Name the tokenizer class ``PreTrainedTokenizerFast``, which transformers 4.x and 5.x both resolve, and
    drop the load-time options (``local_files_only``...) that saving copies into ``tokenizer_config.json``."""
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("is_local", "local_files_only", "gguf_file"):
        cfg.pop(key, None)
    path.write_text(json.dumps(cfg, indent=2) + "\n")
