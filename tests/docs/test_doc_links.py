"""Every relative link of README.md and docs/*.md leads somewhere: the file it names is there and its #anchor is a
heading of that page (as GitHub spells a heading's anchor). A heading renamed or a page moved fails here, not when a
reader clicks. And every table row is inside its table: a row set apart by a blank line, or one broken over two
lines, renders as loose text."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _prose(text: str) -> str:
    """The text without fenced blocks and code spans, where a ``](x)`` is code, not a link."""
    text = re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.replace("`", "").strip().lower())
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Each heading's anchor (a repeated heading gets -1, -2, … as on GitHub) and each explicit <a id/name>."""
    seen: dict[str, int] = {}
    out = set(re.findall(r'<a (?:name|id)="([^"]+)"', text))
    for m in re.finditer(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.M | re.S),
                         flags=re.M):
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(page: Path, text: str) -> list[str]:
    wrong = []
    for m in re.finditer(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", _prose(text)):
        link = m.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", link):  # http:, https:, mailto:
            continue
        path, _, fragment = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            wrong.append(f"{link}: no such file")
        elif fragment and target.suffix == ".md":
            if fragment not in anchors(target.read_text() if path else text):
                wrong.append(f"{link}: no heading #{fragment} in {target.name}")
    return wrong


def broken_tables(text: str) -> list[str]:
    """Lines of a table that render outside it: a row after a blank line with no header and separator of its own,
    or a row's continuation on a line that does not start with ``|``."""
    lines = re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.M | re.S).splitlines()
    wrong, in_table = [], False
    for i, line in enumerate(lines):
        if line.startswith("|"):
            if not in_table and not re.match(r"^\|[\s:|-]+$", lines[i + 1] if i + 1 < len(lines) else ""):
                wrong.append(f"a row with no table: {line[:60]}")
            in_table = True
        elif in_table and line.strip():
            wrong.append(f"a row broken over lines: {line[:60]}")
        else:
            in_table = False
    return wrong


def test_every_table_row_is_inside_its_table() -> None:
    wrong = [f"{p.relative_to(ROOT)}: {w}" for p in PAGES for w in broken_tables(p.read_text())]
    assert wrong == [], "\n".join(wrong)
    shown = "| a | b |\n|---|---|\n| 1 | 2 |\n\n| 3 | 4 |\n| 5 | six\nand more |\n"
    assert broken_tables(shown) == ["a row with no table: | 3 | 4 |", "a row broken over lines: and more |"]


def test_every_relative_link_and_anchor_resolves() -> None:
    links = sum(len(re.findall(r"\]\((?![a-z]+:)[^)\s]+\)", _prose(p.read_text()))) for p in PAGES)
    assert links > 50, links  # the extraction found the pages' links
    wrong = [f"{p.relative_to(ROOT)}: {w}" for p in PAGES for w in broken_links(p, p.read_text())]
    assert wrong == [], "\n".join(wrong)


def test_the_check_sees_a_missing_file_and_a_missing_anchor() -> None:
    page = ROOT / "docs" / "api.md"
    text = "## Webhooks and `hooks`\n## Webhooks and hooks\nSee [a](#webhooks-and-hooks-1), [b](memory.md#search-hits)."
    assert broken_links(page, text) == []
    bad = "See [a](#no-such-heading), [b](nosuch.md), [c](memory.md#nowhere), `[d](#code-span)`."
    assert broken_links(page, bad) == ["#no-such-heading: no heading #no-such-heading in api.md",
                                       "nosuch.md: no such file", "memory.md#nowhere: no heading #nowhere in memory.md"]
