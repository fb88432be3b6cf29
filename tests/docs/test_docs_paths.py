"""Every file the README, docs/ and examples/ point a reader to is there: the tests named as proof of a claim
(`tests/timetravel/test_crash.py`, `…::test_name` with that test in it), the modules named as where something lives
(`runtime/sizing.py` under src/moorage/), the scripts, examples and other pages. A file renamed or a test removed
leaves no dangling pointer. Benchmark reports under bench/results/ are written by their runs, not all committed."""

from __future__ import annotations

import re
from pathlib import Path

from tests.cli.test_docs_commands import DOCS, ROOT

ROOTED = r"(?:tests|bench|src/moorage|scripts|examples|docs)/[A-Za-z0-9_./-]+?\.(?:py|md|json|sh|toml|txt)"


def _pointers(text: str) -> list[tuple[str, str | None]]:
    """(path from the repository root, test or function named after ``::``) of each file a text names."""
    out = []
    for m in re.finditer(rf"(?<![\w/.])({ROOTED})(?:::(\w+))?", text):
        if not m.group(1).startswith("bench/results/"):
            out.append((m.group(1), m.group(2)))
    for m in re.finditer(r"`([a-z_]+/[A-Za-z0-9_/]+\.py)(?:::(\w+))?`", text):  # a module, from src/moorage/
        if m.group(1).split("/")[0] not in ("tests", "bench", "src", "scripts", "examples", "docs", "moorage"):
            out.append(("src/moorage/" + m.group(1), m.group(2)))
        elif m.group(1).startswith("moorage/"):
            out.append(("src/" + m.group(1), m.group(2)))
    return out


def _problems(text: str) -> list[str]:
    wrong = []
    for path, name in _pointers(text):
        f = ROOT / path
        if not f.exists():
            wrong.append(f"{path}: no such file")
        elif name and f.suffix == ".py" and not re.search(rf"^\s*(?:async )?def {name}\b|^class {name}\b", f.read_text(),
                                                          flags=re.M):
            wrong.append(f"{path}::{name}: no such test or function in it")
    return wrong


def test_every_file_the_docs_name_is_there() -> None:
    seen = sum(len(_pointers(doc.read_text())) for doc in DOCS)
    assert seen > 300, seen  # the extraction found the docs' pointers
    wrong = [f"{doc.relative_to(ROOT)}: {p}" for doc in DOCS for p in _problems(doc.read_text())]
    assert wrong == [], "\n".join(wrong)


def test_the_check_sees_a_missing_file_and_a_missing_test() -> None:
    assert _problems("`tests/timetravel/test_crash.py`, `runtime/sizing.py`, `moorage/store/bloblog.py`") == []
    assert _problems("(tests/timetravel/test_no_such_file.py)") == ["tests/timetravel/test_no_such_file.py: no such file"]
    assert _problems("`runtime/no_such.py`") == ["src/moorage/runtime/no_such.py: no such file"]
    assert _problems("`tests/sandbox/test_fairness.py::test_no_such_test`") == [
        "tests/sandbox/test_fairness.py::test_no_such_test: no such test or function in it"]
    assert _problems("see `bench/results/latest/durable.md`") == []  # written by the benchmark's run
