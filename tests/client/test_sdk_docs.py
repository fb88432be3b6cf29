"""Every SDK method docs/sdk.md names (its Methods list and the `sdk.…(` calls of its examples) exists on both
clients, so the page cannot drift from moorage.client."""

from __future__ import annotations

import re
from pathlib import Path

from moorage import AsyncClient, Client

SDK_MD = Path(__file__).resolve().parents[2] / "docs" / "sdk.md"
#: Backticked words of the Methods section that are not methods: retention kinds, key scopes, answer fields.
NOT_METHODS = {"session", "user", "workflow", "executions", "usage", "traces", "webhooks", "admin", "provision", "read", "invoke",
               "deploy", "secrets", "url", "token", "data", "next_cursor"}


def test_every_method_the_page_names_exists_on_both_clients() -> None:
    text = SDK_MD.read_text()
    methods = text.split("## Methods", 1)[1].split("\n## ", 1)[0]
    named = {n for n in re.findall(r"`([a-z_]+)`", methods) if n not in NOT_METHODS}
    named |= set(re.findall(r"\bsdk\.([a-z_]+)\(", text))
    assert len(named) > 40, sorted(named)
    missing = sorted(n for n in named if not (callable(getattr(Client, n, None)) and callable(getattr(AsyncClient, n, None))))
    assert not missing, missing
