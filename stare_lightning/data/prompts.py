"""Prompt records rendered and tokenised: the chat template, plain prompts, left truncation.

Chat records are rendered with the tokenizer's chat template (``add_generation_prompt=True``); a plain
``prompt`` string is wrapped as one user message when the prompt style is ``instruct`` and the tokenizer
has a chat template, and is otherwise tokenised as it is (``add_special_tokens=True``: a BOS token is
added by tokenizers that define one). ``encode_prompt`` is public so supervised training can encode
prompts the same way.
"""

from __future__ import annotations

import warnings
from typing import Any

from .records import PromptRecord


def has_chat_template(tokenizer: Any) -> bool:
    """True when the tokenizer carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def render_prompt(record: PromptRecord, tokenizer: Any, style: str) -> tuple[str, bool]:
    """The prompt text to tokenise and whether it came from the chat template."""
    if record.messages is not None:
        if not has_chat_template(tokenizer):
            raise ValueError(
                f"record {record.id!r} holds chat messages but the tokenizer has no chat template; "
                "use data.prompt_style=plain (built-in tasks) or a tokenizer with a chat template"
            )
        return tokenizer.apply_chat_template(record.messages, tokenize=False, add_generation_prompt=True), True
    if style == "instruct" and has_chat_template(tokenizer):
        messages = [{"role": "user", "content": record.prompt}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), True
    return record.prompt, False


def encode_prompt(record: PromptRecord, tokenizer: Any, *, style: str, max_length: int) -> tuple[list[int], str, bool]:
    """``(prompt_ids, prompt_text, truncated)`` for one record; ids keep the last ``max_length`` tokens."""
    text, templated = render_prompt(record, tokenizer, style)
    ids = list(tokenizer(text, add_special_tokens=not templated)["input_ids"])
    if not ids:
        raise ValueError(f"record {record.id!r}: the prompt encodes to no tokens")
    truncated = len(ids) > max_length
    if truncated:
        ids = ids[-max_length:]
    return ids, text, truncated


class PromptEncoder:
    """Turns records into item dicts; warns once about truncated prompts.

    Nothing is cached: encoding a step's prompts costs milliseconds, while caching every prompt of a
    large data set would cost memory on every rank.
    """

    def __init__(self, tokenizer: Any, style: str, max_length: int) -> None:
        self.tokenizer = tokenizer
        self.style = style
        self.max_length = max_length
        self._warned = False

    def __call__(self, record: PromptRecord) -> dict:
        ids, text, truncated = encode_prompt(record, self.tokenizer, style=self.style, max_length=self.max_length)
        if truncated and not self._warned:
            self._warned = True
            warnings.warn(
                f"prompt of record {record.id!r} is longer than data.max_prompt_length={self.max_length} tokens "
                "and was left-truncated (further truncations are not reported)",
                stacklevel=2,
            )
        return {
            "id": record.id,
            "prompt_ids": ids,
            "prompt_text": text,
            "answer": record.answer,
            "verifier": record.verifier,
            "metadata": dict(record.metadata),
        }
