"""Pieces of the benchmarks that the areas share: Markdown table parts, latency summaries, a baseline's source."""

from __future__ import annotations

import io
import statistics
import subprocess
import tarfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


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


def baseline_src(rev: str, scratch: Path) -> Path:
    """The ``src`` folder of git revision ``rev`` of this checkout, extracted under ``scratch``: hosts started with
    it on their ``PYTHONPATH`` run that revision's code (a baseline measured in the same run)."""
    data = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "src"], check=True, capture_output=True).stdout
    dest = scratch / f"baseline-src-{rev}"
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(dest)
    return dest / "src"
