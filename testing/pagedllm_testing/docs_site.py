"""The documentation as the tests read it: the hand-written Markdown (the README and docs/),
its fenced blocks and inline code, and the generators of the reference pages
(docs/hooks/), loaded as MkDocs loads its hooks."""

from __future__ import annotations

import importlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
HOOKS = DOCS / "hooks"
README = REPO / "README.md"
# A fence opens with ``` and an optional language, and closes with ``` alone on its line; a
# fence inside a list item is indented.
FENCE = re.compile(r"^( *)```(\w*)[^\n]*\n(.*?)^\1```[ \t]*$", re.MULTILINE | re.DOTALL)
# An HTML comment right above a fence (blank lines between allowed).
COMMENT_ABOVE = re.compile(r"<!--((?:(?!-->).)*)-->\s*$", re.DOTALL)
INLINE = re.compile(r"(?<!`)`([^`]+)`(?!`)")


@dataclass(frozen=True)
class Block:
    language: str
    text: str
    note: str  # the HTML comment right above the fence, "" without one


def hook(name: str) -> ModuleType:
    """A module of docs/hooks/, importing its siblings as MkDocs lets a hook do."""
    if name in sys.modules:
        return sys.modules[name]
    saved = sys.path.copy()
    sys.path.insert(0, str(HOOKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path[:] = saved


def pages() -> dict[str, str]:
    """Every hand-written page (the README included): path relative to the repository ->
    text. The reference pages are not among them: they exist only in the built site."""
    found = {"README.md": README.read_text()}
    for path in sorted(DOCS.rglob("*.md")):
        found[str(path.relative_to(REPO))] = path.read_text()
    return found


def blocks(text: str) -> list[Block]:
    found = []
    for match in FENCE.finditer(text):
        above = COMMENT_ABOVE.search(text[: match.start()])
        note = above.group(1).strip() if above else ""
        indent = len(match.group(1))
        body = "\n".join(line[indent:] for line in match.group(3).splitlines())
        found.append(Block(match.group(2), body, note))
    return found


def prose(text: str) -> str:
    """The text outside fenced blocks."""
    return FENCE.sub("", text)


def inline_code(text: str) -> list[str]:
    """The inline code spans of the prose, a span broken over lines joined by a space."""
    return [" ".join(span.split()) for span in INLINE.findall(prose(text))]
