"""MkDocs hook: the pages' formulas as MathML, written into the HTML when the site is built.

The Markdown writes TeX between ``$...$`` (inline) and ``$$...$$`` (display); ``pymdownx.arithmatex`` in its generic
mode finds them (never inside code) and leaves ``<span class="arithmatex">\\(...\\)</span>`` and
``<div class="arithmatex">\\[...\\]</div>``. This hook replaces each with the MathML that ``latex2mathml`` (pure
Python, in the dev extra) converts it to. Browsers lay out MathML themselves, so the maths needs no script, no font
and no other host: the site reads the same offline. A formula that does not convert (an unknown command comes back
as a backslash in the MathML) fails the build, naming the page and the formula.
"""

from __future__ import annotations

import html
import re

from latex2mathml.converter import convert

_MATH = re.compile(
    r'<span class="arithmatex">\\\((?P<inline>.*?)\\\)</span>|<div class="arithmatex">\\\[(?P<display>.*?)\\\]</div>',
    re.DOTALL,
)


def to_mathml(tex: str, display: bool = False, where: str = "") -> str:
    """MathML for one formula; ValueError for one that ``latex2mathml`` does not understand."""
    mathml = convert(tex.strip(), display="block" if display else "inline")
    if "\\" in mathml:
        raise ValueError(f"{where}: the formula {tex.strip()!r} has a command latex2mathml does not know")
    return mathml


def render(page_html: str, where: str = "") -> str:
    """``page_html`` with every formula arithmatex marked replaced by its MathML."""

    def replace(match: re.Match) -> str:
        display = match["display"] is not None
        tex = html.unescape(match["display"] if display else match["inline"])
        mathml = to_mathml(tex, display, where)
        return f'<div class="math-display">{mathml}</div>' if display else mathml

    return _MATH.sub(replace, page_html)


def on_page_content(page_html, page, config, files):
    return render(page_html, where=page.file.src_uri)
