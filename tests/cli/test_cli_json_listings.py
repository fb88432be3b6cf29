"""Every CLI listing's `--json` has one shape, the HTTP API's for its list routes: an object whose "data" holds the
items (with "next_cursor" where the command shows one page of a paged route, and what the listing shows besides
as keys next to them). It was a bare list for some commands and an object for others. docs/cli.md names them."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any, Iterator

import pytest
from typer.testing import CliRunner

from moorage import AsyncClient
from moorage.cli.main import app
from moorage.store import Store
from moorage.store.sqlite import SQLiteBackend
from tests.api.conftest import acme, agent_archive, live_rt, runtime  # noqa: F401  (fixtures)
from tests.cli.test_cli_json import ONLY_ACT, commands
from tests.cli.test_cli_live import app_archive

ROOT = Path(__file__).resolve().parents[2]

#: The commands whose --json is a list of things, and the keys their object may hold beside "data".
LISTINGS: dict[str, set[str]] = {
    "agents": set(), "users": set(), "ps": {"counts"}, "logs": {"next_cursor"}, "share --list": set(),
    "secrets list": set(), "memory facts": set(), "memory search": set(), "memory pending": set(),
    "checkpoints list": {"object", "agent", "user", "head", "branch", "store_bytes", "sandbox_bytes", "branches",
                         "next_cursor"},
    "hosts": set(), "image list": set(), "llm providers": set(), "store tenants": set(),
    "cost trace scenarios": set(), "doctor": set(), "deployments list": set(),
}
#: The commands whose --json is one thing: what was made, done or measured.
ONE_THING = {
    "version", "deploy", "rollback", "invoke", "submit", "execution", "user", "answer", "sleep", "wake", "checkpoint",
    "fork", "forget", "trace", "usage", "share", "memory eval", "memory confirm", "memory reject", "checkpoints take",
    "checkpoints rollback", "checkpoints fork", "image build", "llm chat", "store info", "store sweep",
    "store create-tenant", "store tenant-limits", "cost simulate", "cost prices", "deployments delete",
    "agents delete", "store delete-tenant",
}


def test_every_command_that_takes_json_is_a_listing_or_one_thing() -> None:
    taking = {name for name in commands() if name not in ONLY_ACT and name != "host"}  # `host`: `hosts` again
    listed = {name.split(" --")[0] for name in LISTINGS} - {"share"}
    assert not (listed & ONE_THING), listed & ONE_THING
    assert taking == listed | ONE_THING, (taking - listed - ONE_THING, (listed | ONE_THING) - taking)


def test_docs_name_every_listing() -> None:
    text = (ROOT / "docs" / "cli.md").read_text()
    section = text[text.index("## `--json`"):]
    named = {" ".join(m.split()) for m in re.findall(r"^\| `moorage ([^`]+)`", section, flags=re.M)}
    assert named == set(LISTINGS), (named - set(LISTINGS), set(LISTINGS) - named)


def listing(r: Any, name: str) -> list[Any]:
    """The items of a listing's --json, asserting its shape."""
    assert r.exit_code == 0, (name, r.output)
    out = json.loads(r.stdout)
    assert isinstance(out, dict) and isinstance(out.get("data"), list), (name, out)
    assert set(out) - {"data"} <= LISTINGS[name], (name, set(out))
    return out["data"]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    """The CLI is the subject here, not the backend: one store, SQLite (at <tmp_path>/store, as a data dir's)."""
    s = Store(SQLiteBackend(tmp_path / "store"), max_value_bytes=64 * 1024)
    yield s
    s.close()


async def test_every_listing_prints_the_apis_list_shape(live_rt, acme, tmp_path: Path) -> None:  # noqa: F811
    async with AsyncClient(live_rt.url, acme) as sdk:
        await sdk.deploy("web", app_archive(live_rt.data_dir.parent, "web"))
        await sdk.invoke("web", "hello heron", user="ada")
        await sdk.create_share_link("web", "ada", ttl_s=600, label="review")
    env = {"MOORAGE_API_URL": live_rt.url, "MOORAGE_API_KEY": acme, "MOORAGE_DATA_DIR": str(tmp_path)}

    def run(*args: str, input: str | None = None) -> Any:
        return CliRunner().invoke(app, list(args), env=env, input=input)

    def shown(name: str, *args: str) -> list[Any]:
        return listing(run(*args, "--json"), name)

    made = await asyncio.to_thread(run, "secrets", "set", "web", "TOKEN", input="s3cret\n")
    assert made.exit_code == 0, made.output
    operator = ["--tenant", "acme", "--agent", "web", "--user", "ada"]
    seen = {
        "agents": await asyncio.to_thread(shown, "agents", "agents"),
        "users": await asyncio.to_thread(shown, "users", "users", "web"),
        "ps": await asyncio.to_thread(shown, "ps", "ps"),
        "logs": await asyncio.to_thread(shown, "logs", "logs", "--limit", "5"),
        "share --list": await asyncio.to_thread(shown, "share --list", "share", "web", "ada", "--list"),
        "secrets list": await asyncio.to_thread(shown, "secrets list", "secrets", "list", "web"),
        "memory facts": await asyncio.to_thread(shown, "memory facts", "memory", "facts", *operator),
        "memory search": await asyncio.to_thread(shown, "memory search", "memory", "search", "heron", *operator,
                                                 "-s", "default"),
        "memory pending": await asyncio.to_thread(shown, "memory pending", "memory", "pending", "web", "ada"),
        "checkpoints list": await asyncio.to_thread(shown, "checkpoints list", "checkpoints", "list", "web", "ada"),
        "store tenants": await asyncio.to_thread(shown, "store tenants", "store", "tenants"),
        "deployments list": await asyncio.to_thread(shown, "deployments list", "deployments", "list", "web"),
        "image list": await asyncio.to_thread(shown, "image list", "image", "list", "--images-dir",
                                              str(tmp_path / "no-images")),
        "llm providers": await asyncio.to_thread(shown, "llm providers", "llm", "providers"),
        "cost trace scenarios": await asyncio.to_thread(shown, "cost trace scenarios", "cost", "trace", "scenarios"),
    }
    # Each holds what the host has: the items themselves, not a wrapper around them.
    assert [a["name"] for a in seen["agents"]] == ["web"] and [u["id"] for u in seen["users"]] == ["ada"]
    assert len(seen["ps"]) == 1 and seen["logs"] and [s["label"] for s in seen["share --list"]] == ["review"]
    assert [s["name"] for s in seen["secrets list"]] == ["TOKEN"] and seen["memory pending"] == []
    assert any("heron" in h["event"]["content"] for h in seen["memory search"]) and seen["checkpoints list"]
    assert [t["name"] for t in seen["store tenants"]] == ["acme"] and seen["image list"] == []
    assert [(d["number"], d["status"]) for d in seen["deployments list"]] == [(1, "ready")]
    assert seen["memory facts"] == [] and {p["name"] for p in seen["llm providers"]} >= {"embedded", "openai"}
    assert "steady" in {s["name"] for s in seen["cost trace scenarios"]}


def test_hosts_lists_in_the_same_shape(pg_url: str) -> None:
    assert listing(CliRunner().invoke(app, ["hosts", "--store-url", pg_url, "--json"]), "hosts") == []
