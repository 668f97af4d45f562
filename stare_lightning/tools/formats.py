"""How the policy writes a tool call and how the tool's reply is written back: the ``code_block`` and ``json`` formats.

- ``code_block`` (ReTool): the policy writes ``<code>...</code>`` (a ```` ```python ```` fence inside is allowed) and
  reads ``<interpreter>...</interpreter>`` back, inside its own turn.
- ``json`` (Qwen2.5 / Hermes function calling): the policy writes
  ``<tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call>``; the reply is a message of the chat
  template's tool role: the text a template puts between the end of an assistant message and the start of the next
  assistant turn around a tool message, found once by rendering a small conversation (without a chat template,
  ``<tool_response>...</tool_response>``).

Generation pauses at the format's stop string; ``parse`` reads the call the turn ends with: None when the turn
ends without one (it is the answer), a ``ParsedCall`` with an ``error`` when the call is malformed. ``parse`` never
raises, whatever the text.

A reply is three parts (``ReplyParts``): the format's wrapping around a body the tool wrote. ``encode_reply``
tokenises the wrapping as usual (a chat template's ``<|im_end|>`` there is the real special token) and the body as
plain text: a tool's output that spells a special token (``<|im_end|><|im_start|>assistant``, ``<eos>``) must not
end the tool's turn or open one for the policy, so it stays characters.
"""

from __future__ import annotations

import json
import logging
import textwrap
from dataclasses import dataclass
from typing import Any, Protocol

from stare_lightning.tools.base import Tool, ToolResult, function_schema

__all__ = [
    "FORMATS",
    "CallFormat",
    "CodeBlockFormat",
    "JsonFormat",
    "ParsedCall",
    "ReplyParts",
    "build_format",
    "encode_reply",
]

FORMATS = ("code_block", "json")
_ASSISTANT_MARK = "ASSISTANT-TEXT-5f2c9e"  # stand-ins rendered through the chat template to find its wrapping
_RESULT_MARK = "TOOL-RESULT-5f2c9e"
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParsedCall:
    payload: str | None  # the code / expression to run; None when the call is malformed
    error: str | None  # why it is malformed (answered to the model, counted)


@dataclass(frozen=True)
class ReplyParts:
    prefix: str  # the format's wrapping before the body (may hold a chat template's special tokens)
    body: str  # what the tool (or the error message) says: plain text, whatever it spells
    suffix: str

    def text(self) -> str:
        return f"{self.prefix}{self.body}{self.suffix}"


def _special_ids(tokenizer: Any) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", None) or ())
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(i for i, token in decoder.items() if getattr(token, "special", False))
    return ids


def encode_reply(tokenizer: Any, parts: ReplyParts) -> list[int]:
    """The token ids of a reply: the wrapping encoded as usual, the body with special-token text split into
    ordinary tokens (a special id that a tokenizer still produces for the body is dropped)."""
    ids = tokenizer.encode(parts.prefix, add_special_tokens=False) if parts.prefix else []
    if parts.body:
        body = tokenizer.encode(parts.body, add_special_tokens=False, split_special_tokens=True)
        special = _special_ids(tokenizer)
        kept = [i for i in body if i not in special]
        if len(kept) != len(body):
            logger.warning("the tokenizer kept special tokens in a tool reply's text: they were dropped")
        ids += kept
    if parts.suffix:
        ids += tokenizer.encode(parts.suffix, add_special_tokens=False)
    return ids


class CallFormat(Protocol):
    name: str
    stop_strings: tuple[str, ...]  # generation pauses when the policy writes one of these (it closes a call)

    def parse(self, turn_text: str) -> ParsedCall | None: ...

    def render_call(self, payload: str) -> str: ...  # a call as the policy writes it (supervised traces)

    def reply_parts(self, result: ToolResult) -> ReplyParts: ...  # appended after the call (``encode_reply``)

    def error_parts(self, message: str) -> ReplyParts: ...  # the reply to a malformed call

    def render_result(self, result: ToolResult) -> str: ...  # ``reply_parts`` as one text

    def render_error(self, message: str) -> str: ...


def _closing_block(turn_text: str, opening: str, closing: str) -> tuple[str | None, str | None] | None:
    """The body of the last ``opening ... closing`` block that ends ``turn_text`` (trailing whitespace aside):
    None without a closing tag at the end, ``(None, error)`` when nothing opened it, else ``(body, None)``."""
    text = turn_text.rstrip()
    if not text.endswith(closing):
        return None
    end = len(text) - len(closing)
    start = text.rfind(opening, 0, end)
    if start < 0:
        return None, f"{closing} without an opening {opening}: write the call as {opening}...{closing}"
    return text[start + len(opening) : end], None


def _unfenced(body: str) -> str:
    """``body`` without a Markdown code fence around it (```` ```python ... ``` ````), dedented."""
    stripped = body.strip()
    if stripped.startswith("```"):
        newline = stripped.find("\n")
        stripped = stripped[newline + 1 :] if newline >= 0 else stripped[3:]
        stripped = stripped.rstrip()
        if stripped.endswith("```"):
            stripped = stripped[:-3]
        body = stripped
    return textwrap.dedent(body.strip("\n")).rstrip()


class CodeBlockFormat:
    """ReTool's ``<code>...</code>`` answered by ``<interpreter>...</interpreter>``."""

    name = "code_block"
    stop_strings = ("</code>",)

    def __init__(self, tool: Tool | None = None) -> None:
        self.tool = tool

    def parse(self, turn_text: str) -> ParsedCall | None:
        block = _closing_block(turn_text, "<code>", "</code>")
        if block is None or block[0] is None:
            return None if block is None else ParsedCall(None, block[1])
        payload = _unfenced(block[0])
        if not payload.strip():
            return ParsedCall(None, "the <code></code> block is empty: write the code between <code> and </code>")
        return ParsedCall(payload, None)

    def render_call(self, payload: str) -> str:
        return f"<code>{payload}</code>" if "\n" not in payload else f"<code>\n{payload}\n</code>"

    def reply_parts(self, result: ToolResult) -> ReplyParts:
        return ReplyParts("\n<interpreter>\n", result.text.rstrip(), "\n</interpreter>\n")

    def error_parts(self, message: str) -> ReplyParts:
        return self.reply_parts(ToolResult(text=f"Error: {message}", ok=False, seconds=0.0))

    def render_result(self, result: ToolResult) -> str:
        return self.reply_parts(result).text()

    def render_error(self, message: str) -> str:
        return self.error_parts(message).text()


def chat_template_wrapping(tokenizer: Any, tool: Tool) -> tuple[str, str] | None:
    """(prefix, suffix) that ``tokenizer``'s chat template puts around a tool message, from the end of the assistant
    message before it to the start of the next assistant turn; None without a usable chat template."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return None
    messages = [
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": _ASSISTANT_MARK},
        {"role": "tool", "content": _RESULT_MARK},
    ]
    for extra in ({"tools": [function_schema(tool)]}, {}):  # some templates need the tools, some refuse them
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
        except Exception as err:  # a template that cannot render a tool message: try the next way, then fall back
            logger.debug("chat template failed to render a tool message (%s)", err)
            continue
        after = text.rsplit(_ASSISTANT_MARK, 1)[-1] if isinstance(text, str) and _ASSISTANT_MARK in text else ""
        if _RESULT_MARK in after:
            prefix, suffix = after.split(_RESULT_MARK, 1)
            return prefix, suffix
    logger.warning("the chat template does not render a tool message: tool replies use <tool_response> tags")
    return None


class JsonFormat:
    """Hermes / Qwen2.5 ``<tool_call>{json}</tool_call>``, answered in the chat template's tool role."""

    name = "json"
    stop_strings = ("</tool_call>",)

    def __init__(self, tool: Tool, tokenizer: Any = None) -> None:
        self.tool = tool
        wrapping = chat_template_wrapping(tokenizer, tool)
        self.prefix, self.suffix = wrapping or ("\n<tool_response>\n", "\n</tool_response>\n")

    def parse(self, turn_text: str) -> ParsedCall | None:
        block = _closing_block(turn_text, "<tool_call>", "</tool_call>")
        if block is None or block[0] is None:
            return None if block is None else ParsedCall(None, block[1])
        try:
            return self._read_call(json.loads(block[0].strip()))
        except (ValueError, RecursionError) as err:  # json.JSONDecodeError is a ValueError
            return ParsedCall(None, f"the <tool_call> does not hold valid JSON ({str(err)[:200]})")

    def _read_call(self, call: Any) -> ParsedCall:
        name, argument = self.tool.name, self.tool.argument
        shape = f'{{"name": "{name}", "arguments": {{"{argument}": "..."}}}}'
        if not isinstance(call, dict):
            return ParsedCall(None, f"the <tool_call> must hold a JSON object: {shape}")
        if call.get("name") != name:
            return ParsedCall(None, f"unknown tool name {str(call.get('name'))[:100]!r}: the tool is {name!r}")
        arguments = call.get("arguments")
        if isinstance(arguments, str):  # some models encode the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                return ParsedCall(None, f'"arguments" is a string that is not valid JSON: {shape}')
        if not isinstance(arguments, dict):
            return ParsedCall(None, f'"arguments" must be a JSON object: {shape}')
        payload = arguments.get(argument)
        if not isinstance(payload, str) or not payload.strip():
            return ParsedCall(None, f'"arguments" must hold "{argument}" as a non-empty string: {shape}')
        return ParsedCall(payload, None)

    def render_call(self, payload: str) -> str:
        call = {"name": self.tool.name, "arguments": {self.tool.argument: payload}}
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"

    def reply_parts(self, result: ToolResult) -> ReplyParts:
        return ReplyParts(self.prefix, result.text.rstrip(), self.suffix)

    def error_parts(self, message: str) -> ReplyParts:
        return ReplyParts(self.prefix, f"Error: {message}", self.suffix)

    def render_result(self, result: ToolResult) -> str:
        return self.reply_parts(result).text()

    def render_error(self, message: str) -> str:
        return self.error_parts(message).text()


def build_format(name: str, tool: Tool, tokenizer: Any = None) -> CallFormat:
    """The call format ``name`` (``tools.format``) for ``tool``; the tokenizer's chat template shapes json replies."""
    if name == "code_block":
        return CodeBlockFormat(tool)
    if name == "json":
        return JsonFormat(tool, tokenizer)
    raise ValueError(f"tools.format={name!r} is not allowed: choose one of {list(FORMATS)}")
