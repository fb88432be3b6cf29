"""What each part of moorage may import (STYLE.md: a reader can tell from the tree where a line belongs and what it
may import). Every import counts, those under ``TYPE_CHECKING`` and inside functions too: a type-only import is
still a dependency a reader has to follow."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "moorage"

#: The parts that serve the others: none of them may import a part that runs agents, speaks HTTP or owns a fleet.
FOUNDATION = {"aio", "clock", "config", "cpus", "errors", "fds", "fsync", "log", "store", "sandbox", "objects"}
UPPER = {"runtime", "api", "cli", "web", "lifecycle", "timetravel", "fleet", "router", "webhooks", "devservices"}
#: Parts below the runtime, which the runtime drives: they see a turn through a protocol of their own.
BELOW_RUNTIME = {"timetravel", "lifecycle", "router", "durable", "memory", "usage", "egress", "secrets",
                 "observability", "llm", "cost"} | FOUNDATION


def _imports(path: Path) -> set[str]:
    """The top-level moorage parts ``path`` imports (absolute and relative imports alike)."""
    rel = path.relative_to(SRC).parts
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ["moorage", *rel[:-1]][: len(rel) + 1 - node.level]
                names = [".".join(base + ([node.module] if node.module else []))]
            else:
                names = [node.module or ""]
        found |= {n.split(".")[1] for n in names if n.startswith("moorage.") and n.count(".") >= 1}
    return found


def _graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).parts
        part = rel[0] if len(rel) > 1 else rel[0].removesuffix(".py")
        edges.setdefault(part, set()).update(_imports(path) - {part})
    return edges


def test_the_parse_sees_known_edges() -> None:
    """The check below is only as good as the parse: it must find edges that are known to be there."""
    g = _graph()
    assert {"store", "sandbox", "timetravel"} <= g["runtime"]
    assert "store" in g["timetravel"] and "errors" in g["store"]


def test_guest_code_and_host_code_never_import_each_other() -> None:
    g = _graph()
    assert g["guest"] == set(), f"guest code imports host parts: {sorted(g['guest'])}"
    assert [p for p, deps in g.items() if "guest" in deps] == []


def test_foundation_parts_import_no_upper_part() -> None:
    g = _graph()
    bad = {p: sorted(g[p] & UPPER) for p in FOUNDATION if g.get(p, set()) & UPPER}
    assert bad == {}


def test_parts_below_the_runtime_do_not_import_it_or_the_api() -> None:
    g = _graph()
    bad = {p: sorted(g[p] & {"runtime", "api", "cli", "web"}) for p in BELOW_RUNTIME
           if g.get(p, set()) & {"runtime", "api", "cli", "web"}}
    assert bad == {}


def test_only_the_api_and_the_cli_import_the_dashboard() -> None:
    g = _graph()
    assert {p for p, deps in g.items() if "web" in deps} <= {"api", "cli"}
