"""MkDocs hook: a list written right under a line of text is a list, in the pages and in the API's docstrings.

Python-Markdown starts a list only after a blank line, so a docstring such as::

    What it implements:
    - GRPO (...): ...
    - Dr.GRPO (...): ...

rendered as one paragraph with the dashes inside it. This hook adds a Markdown preprocessor (before mkdocstrings
builds its own Markdown from the same list of extensions, hence the priority) that puts the blank line in: before a
``- `` or ``* `` item that follows a line of text, and before a numbered item that follows a line ending with a
colon (a wrapped sentence may start with a number). Fenced code is left alone.
"""

from __future__ import annotations

import re

from markdown import Extension
from markdown.preprocessors import Preprocessor
from mkdocs.plugins import event_priority

_BULLET = re.compile(r"( *)[-*] \S")
_NUMBERED = re.compile(r"( *)\d{1,2}\. \S")
_FENCE = re.compile(r" *(```|~~~)")


def blank_lines_before_lists(lines: list[str]) -> list[str]:
    out: list[str] = []
    fenced, in_list = False, False
    for line in lines:
        if _FENCE.match(line):
            fenced = not fenced
        if fenced:
            out.append(line)
            continue
        previous = out[-1] if out else ""
        item = _BULLET.match(line) or (_NUMBERED.match(line) and previous.rstrip().endswith(":"))
        if not line.strip():
            in_list = False
        elif item:
            if previous.strip() and not in_list and not previous.lstrip().startswith(("|", "#", ">")):
                out.append("")
            in_list = True
        out.append(line)
    return out


class _ListsAfterText(Preprocessor):
    def run(self, lines: list[str]) -> list[str]:
        return blank_lines_before_lists(lines)


class ListsAfterText(Extension):
    def extendMarkdown(self, md) -> None:  # noqa: N802 (Python-Markdown's name)
        md.preprocessors.register(_ListsAfterText(md), "lists_after_text", 25)


@event_priority(100)  # before mkdocstrings reads the extensions for the docstrings' Markdown
def on_config(config):
    config.markdown_extensions.append(ListsAfterText())
    return config
