"""The README's "Writing an agent": its moorage.toml and its on_message, deployed as written through `moorage up`
(only `compute_quote`, which the README leaves to the reader, and `users = "auto"`, which it names, added), a turn
that stops at its approval, the answer, and the file it wrote. And every `ctx.…` the README and the agent-facing
pages name is there in the guest, awaited where the README says so."""

from __future__ import annotations

import inspect
import re
import tarfile
from pathlib import Path
from typing import Iterator

import pytest

from moorage import Client
from moorage.devservices.fleet import LocalHost
from moorage.guest.agent_context import LLM, AgentContext, Files, Memory
from tests.cli.test_docs_commands import DOCS, ROOT, fenced_blocks

README = ROOT / "README.md"
#: Pages whose `ctx` is not the agent's: the durable engine's workflow context and the channel's call context.
OTHER_CTX = {"durable.md", "channel.md"}


def _readme_agent() -> tuple[str, str]:
    blocks = fenced_blocks(README.read_text())
    toml = next(body for lang, body in blocks if lang == "toml")
    code = next(body for lang, body in fenced_blocks(README.read_text()) if lang == "python")
    return toml, code


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalHost]:
    server = LocalHost("up", tmp_path_factory.mktemp("readme-agent") / "data", {"MOORAGE_LOG_LEVEL": "warning"},
                       start_timeout_s=120)
    try:
        yield server
    finally:
        server.stop()


def test_the_readme_agent_runs_as_written(host: LocalHost, tmp_path: Path) -> None:
    toml, code = _readme_agent()
    assert 'name = "assistant"' in toml and "async def on_message(ctx, message):" in code
    agent = tmp_path / "assistant"
    agent.mkdir()
    # "unless `[agent.lifecycle] users = "auto"` makes them on their first turn, as the examples do"
    (agent / "moorage.toml").write_text(toml + '\n[agent.lifecycle]\nusers = "auto"\n')
    (agent / "agent.py").write_text("def compute_quote():\n    return 42\n\n\n" + code + "\n")
    archive = tmp_path / "assistant.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for f in agent.iterdir():
            tar.add(f, arcname=f.name)
    with Client(host.url, host.key) as sdk:
        sdk.deploy("assistant", str(archive))
        turn = sdk.invoke("assistant", "Hello, I am Ada.", user="ada")
        assert turn["status"] == "waiting" and turn["interrupt"] == {"question": "ship it?"}, turn
        done = sdk.answer(turn["run_id"], "yes")
        assert done["status"] == "done" and isinstance(done["reply"], str) and done["reply"], done
        run = sdk.get_workflow(turn["run_id"])
        assert [s["result"] for s in run["steps"] if s["name"] == "quote"] == [42], run["steps"]
        sid = sdk.get_user("assistant", "ada")["instance"]["sandbox_id"]
        assert sdk.read_file(sid, "notes.txt")["content"] == done["reply"]


def test_every_ctx_name_the_docs_use_is_the_agents() -> None:
    members = {"llm": LLM, "memory": Memory, "files": Files}
    named, missing = 0, []
    for doc in DOCS:
        if doc.name in OTHER_CTX:
            continue
        for name, member in set(re.findall(r"\bctx\.([A-Za-z_]+)(?:\.([A-Za-z_]+))?", doc.read_text())):
            named += 1
            where = members.get(name)
            if not hasattr(AgentContext, name) and name not in members and name not in ("user", "session", "turn_id",
                                                                                        "entity", "agent"):
                missing.append(f"{doc.relative_to(ROOT)}: ctx.{name}")
            elif member and where is not None and not hasattr(where, member):
                missing.append(f"{doc.relative_to(ROOT)}: ctx.{name}.{member}")
    assert named > 20 and missing == [], missing


def test_the_readme_says_which_ctx_calls_are_awaited() -> None:
    """"`ctx` also has (each awaited, as above; only `ctx.files` is plain) `ctx.exec(argv)`, ..."."""
    text = " ".join(README.read_text().split())
    said = text.split("`ctx` also has (each awaited", 1)[1].split("Tools are typed", 1)[0]
    calls = set(re.findall(r"`ctx\.([a-z_]+)(?:\.([a-z_/]+))?[(`]", said))
    calls.discard(("files", ""))  # "only `ctx.files` is plain"
    assert len(calls) >= 8, calls
    for name, member in calls:
        for m in (member.split("/") if member else [""]):
            fn = getattr(Memory, m) if m else getattr(AgentContext, name)
            assert inspect.iscoroutinefunction(fn), f"ctx.{name}{'.' + m if m else ''} is not awaited"
    assert not inspect.iscoroutinefunction(Files.write)
