"""``ctx.fetch`` end to end: an agent in a real (process) sandbox asks the host to fetch; the host's policy
decides. The bypasses of the old prefix check are refused, errors reach the agent as generic words, and an
endless body arrives cut at 1 MiB. Upstreams are loopback servers; the test runtime allows 127.0.0.0/8."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from moorage.runtime.package import AgentPackageError
from moorage.store import EntityKey
from tests.egress.servers import MIB, start_upstream, stop
from tests.runtime.conftest import env, write_agent  # noqa: F401  (fixture)

AGENT = '''
import json

async def on_message(ctx, message):
    try:
        r = await ctx.fetch(message)
        return json.dumps({"status": r["status"], "len": len(r["body"]), "truncated": r["truncated"],
                           "head": r["body"][:40]})
    except ctx.HostError as e:  # the host's typed refusal: a stable kind beside the words
        return json.dumps({"error": str(e), "kind": e.kind, "hint": e.hint})
'''


@pytest.fixture
def upstreams():  # type: ignore[no-untyped-def]
    a, b = start_upstream("A"), start_upstream("B")
    yield a, b
    stop(a)
    stop(b)


async def _ask(env, url: str) -> dict:  # type: ignore[no-untyped-def]
    r = await env.runtime.invoke(env.principal, EntityKey("fetcher", "u"), url)
    return json.loads(r.reply)


async def test_the_old_bypasses_are_refused_inside_a_real_turn(env, tmp_path: Path, upstreams) -> None:  # noqa: F811
    a, b = upstreams
    agent = write_agent(tmp_path / "fetcher", "fetcher", AGENT,
                        f'[agent.egress]\nallow = ["http://127.0.0.1:{a.port}/api"]\n')
    await env.runtime.deploy(env.principal, agent)
    ok = await _ask(env, f"http://127.0.0.1:{a.port}/api/x")
    assert ok == {"status": 200, "len": len("A GET /api/x"), "truncated": False, "head": "A GET /api/x"}
    for url in (f"http://127.0.0.1:{a.port}@127.0.0.1:{b.port}/api/x",      # userinfo
                f"http://127.0.0.1:{a.port}/api/../admin",                   # dot-dot out of the prefix
                f"http://127.0.0.1:{a.port}/apix",                           # textual prefix, other segment
                f"http://127.0.0.1:{b.port}/api/x"):                         # internal service, other port
        out = await _ask(env, url)
        assert "error" in out and ("not allowed" in out["error"] or "user name" in out["error"]
                                   or "segments" in out["error"]), (url, out)
        assert out["kind"] == "egress-denied", out
    assert a.paths() == ["/api/x"] and b.hits == []


async def test_errors_are_generic_and_endless_bodies_are_cut(env, tmp_path: Path, upstreams) -> None:  # noqa: F811
    a, _ = upstreams
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    a.redirects["/go"] = (302, "http://127.0.0.2:9/elsewhere")
    agent = write_agent(tmp_path / "fetcher", "fetcher", AGENT,
                        f'[agent.egress]\nallow = ["http://127.0.0.1:{a.port}", "http://127.0.0.1:{closed}"]\n')
    await env.runtime.deploy(env.principal, agent)
    refused = await _ask(env, f"http://127.0.0.1:{closed}/")
    assert "could not connect" in refused["error"] and "refused" not in refused["error"].lower()
    assert refused["kind"] == "egress-failed"
    endless = await _ask(env, f"http://127.0.0.1:{a.port}/endless")
    assert endless["status"] == 200 and endless["truncated"] is True and endless["len"] == MIB
    redirected = await _ask(env, f"http://127.0.0.1:{a.port}/go")
    assert "redirected" in redirected["error"] and redirected["kind"] == "egress-denied"


async def test_a_rule_without_a_host_fails_the_deploy(env, tmp_path: Path) -> None:  # noqa: F811
    agent = write_agent(tmp_path / "fetcher", "fetcher", AGENT, '[agent.egress]\nallow = ["http://"]\n')
    with pytest.raises(AgentPackageError, match="names no host"):
        await env.runtime.deploy(env.principal, agent)
