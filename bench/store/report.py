"""Pieces of the store bench's Markdown report that its parts share."""

from __future__ import annotations


def table_head(columns: list[str]) -> list[str]:
    """A Markdown table's header row and separator."""
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def section(title: str, prose: str, columns: list[str]) -> list[str]:
    """A report section's heading, its explanation and the head of its table."""
    return ["", f"## {title}", "", prose, "", *table_head(columns)]
