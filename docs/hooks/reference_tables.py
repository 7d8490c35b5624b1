"""Markdown tables and their cells, as the reference generators write them."""

from __future__ import annotations

# Words in a Markdown table cell: a `|` would end the cell, a `*` start emphasis. (Code spans
# need neither escape: the table extension splits cells outside them only.)
CELL = str.maketrans({"|": "\\|", "*": "\\*", "\n": " "})


def cell(text: str) -> str:
    """Prose for a table cell, its line breaks and runs of spaces folded."""
    return " ".join(text.split()).translate(CELL)


def anchored(anchor: str, text: str) -> str:
    """``text`` with an anchor to link to (#anchor), as for a field or a metric."""
    return f'<span id="{anchor}"></span>{text}'


def table(columns: list[str], rows: list[list[str]]) -> list[str]:
    """The lines of a table; each row's cells are Markdown already."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]
