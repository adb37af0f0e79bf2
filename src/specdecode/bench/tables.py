"""Markdown tables, as every benchmark writes them: `specdecode bench`'s report and the scripts."""

from __future__ import annotations

from collections.abc import Sequence

NONE = "–"  # a cell with nothing measured in it


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A header, its rule and one line a row; cells are written with str()."""
    lines = [row_line(header), rule(len(header))]
    return "\n".join(lines + [row_line(row) for row in rows])


def fmt(value: object, spec: str) -> str:
    """value formatted by spec ("{:.2f}x"), or NONE where nothing was measured."""
    return NONE if value is None else spec.format(value)


def row_line(cells: Sequence[object]) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def rule(columns: int) -> str:
    return "|" + "---|" * columns
