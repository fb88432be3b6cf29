"""Pieces of the benchmarks' reports that the areas share: Markdown table parts and latency summaries."""

from __future__ import annotations

import statistics
from typing import Any


def table_head(columns: list[str]) -> list[str]:
    """A Markdown table's header row and separator."""
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def section(title: str, prose: str, columns: list[str]) -> list[str]:
    """A report section's heading, its explanation and the head of its table."""
    return ["", f"## {title}", "", prose, "", *table_head(columns)]


def pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (nearest rank)."""
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def latency_summary(xs: list[float]) -> dict[str, Any]:
    """n, p50, p99, min and max in milliseconds of durations given in seconds (``{"n": 0}`` for none)."""
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "p50_ms": statistics.median(xs) * 1e3, "p99_ms": pct(xs, 0.99) * 1e3,
            "min_ms": min(xs) * 1e3, "max_ms": max(xs) * 1e3}
