"""A host setting the docs give with its default (`lease_ttl_s` (default 15 s), `app_max_request_bytes` (16 MiB))
says the default `moorage.config.Config` has: a default changed in the code and not on the page fails here."""

from __future__ import annotations

import dataclasses
import re

from moorage.config import Config
from tests.cli.test_docs_commands import DOCS, ROOT

UNITS = {"": 1, "s": 1, "MiB": 1024 * 1024, "GiB": 1024 ** 3, "KiB": 1024}


def _said(text: str) -> list[tuple[str, float, str]]:
    """(setting, value, unit) for each `setting` followed closely by "(default N unit" or "(N unit"."""
    text = " ".join(text.split())
    return [(m.group(1), float(m.group(2)), m.group(3))
            for m in re.finditer(r"`([a-z_]+)`[^`(]{0,20}\((?:default )?(\d+(?:\.\d+)?)\s*(s|MiB|GiB|KiB)?\b", text)]


def _wrong(text: str) -> list[str]:
    defaults = {f.name: getattr(Config(), f.name) for f in dataclasses.fields(Config)}
    wrong = []
    for name, value, unit in _said(text):
        if name not in defaults or not isinstance(defaults[name], (int, float)):
            continue
        # A size in bytes is given in MiB; a size in MiB (`fleet_cache_mib`) in MiB too.
        scale = UNITS[unit or ""] if name.endswith("_bytes") else 1
        if value * scale != defaults[name]:
            wrong.append(f"{name}: the page says {value:g} {unit or ''}, the default is {defaults[name]!r}".strip())
    return wrong


def test_the_defaults_the_docs_give_are_the_codes() -> None:
    seen = sum(1 for doc in DOCS for name, _, _ in _said(doc.read_text())
               if name in {f.name for f in dataclasses.fields(Config)})
    assert seen > 15, seen
    wrong = [f"{doc.relative_to(ROOT)}: {w}" for doc in DOCS for w in _wrong(doc.read_text())]
    assert wrong == [], "\n".join(wrong)


def test_the_check_sees_a_wrong_default() -> None:
    assert _wrong("`lease_ttl_s` (default 15 s) and `app_max_request_bytes` (16 MiB)") == []
    assert _wrong("`heartbeat_s` (default 5 s)") == ["heartbeat_s: the page says 5 s, the default is 3.0"]
    assert _wrong("`app_max_response_bytes` (128 MiB)") == [
        "app_max_response_bytes: the page says 128 MiB, the default is 268435456"]
