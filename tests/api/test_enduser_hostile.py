"""The end-user token as an attacker holds it (it lives in a browser): through the real HTTP server and runtime, what
one end-user can do to their own caps and to the host everybody shares.

- N turns sent at once all passed the caps check before any of them ran, then each ran: a cap overshot N times;
- one end-user naming new sessions took every place of the host's turn queue: every other tenant got 429s;
- async turns were unbounded per end-user (a task and a row each, retried for 15 minutes).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from pathlib import Path
from typing import Any

import httpx

from moorage.store import Store
from tests.api.conftest import aclient, agent_archive

GZ = {"content-type": "application/gzip"}

SLOW_AGENT = '''
import asyncio
import contextlib

async def on_message(ctx, message):
    if message == "slow":
        await asyncio.sleep(1.5)
    if message == "whoami":
        return f"user={ctx.user}"
    return "echo: " + message
'''


async def _setup(c: httpx.AsyncClient, tmp_path: Path, user: str, limits: dict[str, Any] | None = None) -> str:
    """Deploy the slow agent, create ``user`` (with ``limits``) and return an end-user token for them."""
    r = await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path, body=SLOW_AGENT), headers=GZ)
    assert r.status_code == 201, r.text
    assert (await c.put(f"/v1/agents/echo/users/{user}", json={"limits": limits or {}})).status_code == 201
    r = await c.post(f"/v1/agents/echo/users/{user}/tokens", json={"ttl_s": 600})
    assert r.status_code == 201, r.text
    return r.json()["token"]


async def _until(cond: Any, timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.02)


def _lines(runtime: Any, user: str) -> int:
    """Turns of ``user`` admitted by the router (each in its session's line)."""
    return sum(line.members for key, line in list(runtime.router._sessions.items()) if key[2] == user)


async def test_turns_sent_at_once_cannot_overshoot_a_cap(live_rt, runtime, store: Store, acme: str, tmp_path: Path):
    ts = store.tenant(store.authenticate(acme))
    async with aclient(live_rt, acme) as c:
        token = await _setup(c, tmp_path, "ada", {"tokens_per_month": 100})
        assert (await c.post("/v1/agents/echo/invoke", json={"message": "warm", "user": "ada"})).status_code == 200
    await _until(lambda: not runtime.turns)  # the warm turn's automatic checkpoint is over
    async with aclient(live_rt, token) as u:
        first = asyncio.create_task(u.post("/v1/agents/echo/invoke", json={"message": "slow", "session": "s0"}))
        await _until(lambda: runtime.turns)  # the first turn runs in the sandbox
        # Five more at once, each in a session of its own: all checked against the cap now, with nothing used yet.
        rest = [asyncio.create_task(u.post("/v1/agents/echo/invoke", json={"message": "more", "session": f"s{i}"}))
                for i in range(1, 6)]
        await _until(lambda: _lines(runtime, "ada") == 6)
        # What the first turn's model calls cost, written while it runs (as the gateway's usage sink writes it).
        ts.usage.add("input_tokens", 150, agent_id="echo", user_id="ada")
        assert (await first).status_code == 200
        answers = await asyncio.gather(*rest)
    # Each waiting turn is checked again as it gets the instance: the cap is spent, none of them runs.
    assert [r.status_code for r in answers] == [429] * 5, [r.text for r in answers]
    for r in answers:
        assert r.json()["type"].endswith("/cap-exceeded") and "tokens_per_month" in r.json()["detail"]
        assert int(r.headers["retry-after"]) >= 1
    replies = [run for run in ts.runs.list(limit=100) if (run.input or {}).get("message") == "more"]
    assert not [run for run in replies if run.status == "succeeded"]


async def test_one_end_user_cannot_take_the_hosts_turn_queue(live_rt, runtime, store: Store, acme: str,
                                                             globex: str, tmp_path: Path):
    runtime.router.max_pending = 6  # the host's places (1024 by default), small to keep the test short
    runtime.router.max_user_pending = 3
    async with aclient(live_rt, acme) as c:
        token = await _setup(c, tmp_path, "mallory")
        assert (await c.post("/v1/agents/echo/invoke", json={"message": "warm", "user": "mallory"})).status_code == 200
    async with aclient(live_rt, globex) as g:
        r = await g.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path / "g", body=SLOW_AGENT),
                         headers=GZ)
        assert r.status_code == 201, r.text
        assert (await g.put("/v1/agents/echo/users/neighbour", json={})).status_code == 201
        async with aclient(live_rt, token) as u:
            # Eight slow turns, each in a session the attacker makes up: sessions are the caller's to name.
            flood = [asyncio.create_task(u.post("/v1/agents/echo/invoke", json={"message": "slow", "session": f"x{i}"}))
                     for i in range(8)]
            await _until(lambda: sum(t.done() for t in flood) >= 5 or runtime.router.pending >= 6)
            # Another tenant's turn still gets a place on the host.
            r = await g.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "neighbour"})
            assert r.status_code == 200, r.text
            answers = await asyncio.gather(*flood)
    codes = sorted(r.status_code for r in answers)
    assert codes == [200] * 3 + [429] * 5, codes
    refused = [r for r in answers if r.status_code == 429]
    for r in refused:
        assert r.json()["type"].endswith("/overloaded") and "'mallory'" in r.json()["detail"]
        assert r.headers["retry-after"] == "1"


async def test_async_turns_of_one_end_user_are_bounded(live_rt, runtime, store: Store, acme: str, tmp_path: Path):
    from moorage.webhooks.executions import ExecutionRunner

    runner = ExecutionRunner.of(runtime)
    runner.max_user_executions = 3
    async with aclient(live_rt, acme) as c:
        token = await _setup(c, tmp_path, "mallory")
        assert (await c.put("/v1/agents/echo/users/bob", json={})).status_code == 201
        async with aclient(live_rt, token) as u:
            answers = [await u.post("/v1/agents/echo/invoke?async=true", json={"message": "slow", "session": f"a{i}"})
                       for i in range(5)]
            assert [r.status_code for r in answers] == [202] * 3 + [429] * 2, [r.text for r in answers]
            assert answers[3].json()["type"].endswith("/overloaded") and "async" in answers[3].json()["detail"]
            assert answers[3].headers["retry-after"] == "1"
            # Another user of the same tenant is not held back by mallory's.
            r = await c.post("/v1/agents/echo/invoke?async=true", json={"message": "hi", "user": "bob"})
            assert r.status_code == 202, r.text
            ids = [r.json()["id"] for r in answers[:3]]
            for ex_id in ids:
                await _until(lambda ex_id=ex_id: not runner.running(ex_id))
            # Once they finished, mallory may submit again; asked again (its Idempotency-Key), the same execution.
            again = {"Idempotency-Key": "k1"}
            r = await u.post("/v1/agents/echo/invoke?async=true", json={"message": "later"}, headers=again)
            assert r.status_code == 202, r.text
            assert (await u.post("/v1/agents/echo/invoke?async=true", json={"message": "later"},
                                 headers=again)).json()["id"] == r.json()["id"]


async def test_requests_in_flight_per_end_user_are_bounded(live_rt, runtime, store: Store, acme: str, tmp_path: Path):
    ctx = live_rt.app.state.moorage
    ctx.max_end_user_requests = 3  # 32 by default; a browser keeps 6 connections to one origin
    # A stream's answer starts (with keep-alives) 0.1 s after it was asked for, first event or not.
    ctx.config = dataclasses.replace(ctx.config, sse_keepalive_s=0.1)
    async with aclient(live_rt, acme) as c:
        token = await _setup(c, tmp_path, "mallory")
        assert (await c.put("/v1/agents/echo/users/bob", json={})).status_code == 201
        bob = (await c.post("/v1/agents/echo/users/bob/tokens", json={"ttl_s": 600})).json()["token"]
        async with aclient(live_rt, token) as u, aclient(live_rt, bob) as b:
            # Three streamed slow turns, each left open: the stream holds its place until it ends.
            streams = [u.stream("POST", "/v1/agents/echo/invoke?stream=true", json={"message": "slow", "session": f"t{i}"})
                       for i in range(3)]
            opened = [await s.__aenter__() for s in streams]
            assert [r.status_code for r in opened] == [200] * 3
            r = await u.get("/v1/agents/echo/users/mallory/events")
            assert r.status_code == 429, r.text
            assert r.json()["type"].endswith("/too-many-requests") and r.headers["retry-after"] == "1"
            r = await u.post("/v1/agents/echo/invoke", json={"message": "more", "session": "t9"})
            assert r.status_code == 429
            # Other end-users and the tenant's own key are not held back.
            assert (await b.get("/v1/agents/echo/users/bob/events")).status_code == 200
            assert (await c.get("/v1/agents/echo/users/mallory/events")).status_code == 200
            for s, r in zip(streams, opened):
                body = b"".join([chunk async for chunk in r.aiter_bytes()])
                assert b"event: done" in body
                await s.__aexit__(None, None, None)
            # The streams ended: their places are free again.
            assert (await u.get("/v1/agents/echo/users/mallory/events")).status_code == 200
            # A stream the caller leaves before its end frees its place too.
            async with u.stream("POST", "/v1/agents/echo/invoke?stream=true",
                                json={"message": "slow", "session": "left"}) as r:
                assert r.status_code == 200
            await _until(lambda: not ctx.end_user_requests)
    assert ctx.end_user_requests == {}


async def test_a_token_reaches_its_own_user_only_whatever_the_path_query_or_key(live_rt, acme: str, tmp_path: Path):
    async with aclient(live_rt, acme) as c:
        token = await _setup(c, tmp_path, "ada")
        assert (await c.put("/v1/agents/echo/users/bob", json={})).status_code == 201
        assert (await c.post("/v1/agents/echo/invoke", json={"message": "bob's", "user": "bob", "session": "b"})).status_code == 200
        bob_ex = (await c.post("/v1/agents/echo/invoke?async=true", json={"message": "x", "user": "bob"})).json()["id"]
        async with aclient(live_rt, token) as u:
            assert (await u.post("/v1/agents/echo/invoke", json={"message": "mine", "session": "a"})).status_code == 200
            for user in ("bob", "ADA", "\u0430da", "a" * 5000, "ada%2Fx"):
                r = await u.get(f"/v1/agents/echo/users/{user}/events")
                assert r.status_code in (403, 404) and "mine" not in r.text and "bob" not in r.text.lower(), (user, r.text)
            # An encoded slash never becomes a path segment, and no route matches it.
            r = await u.get("/v1/agents/echo/users/ada%2F..%2Fbob/events")
            assert r.status_code == 404 and r.json()["type"].endswith("/no-route")
            # The session listing's ?user= is ignored for a token: its own sessions only.
            r = await u.get("/v1/agents/echo/sessions", params={"user": "bob"})
            assert r.status_code == 200 and {s["user"] for s in r.json()["data"]} == {"ada"}
            # Another user's execution is the 404 of an id that does not exist.
            r, unknown = await u.get(f"/v1/executions/{bob_ex}"), await u.get("/v1/executions/" + "0" * 32)
            assert r.status_code == unknown.status_code == 404
            # A body or a header naming another user changes nothing.
            r = await u.post("/v1/agents/echo/invoke", json={"message": "x", "user": "bob"})
            assert r.status_code == 403
            r = await u.post("/v1/agents/echo/invoke", json={"message": "whoami"}, headers={"X-Moorage-User": "bob"})
            assert r.status_code == 200 and r.json()["reply"] == "user=ada"
            # An Idempotency-Key names a turn of this user: asked again with another message, a 422, never a replay.
            key = {"Idempotency-Key": "same-key"}
            first = await u.post("/v1/agents/echo/invoke", json={"message": "one", "session": "a"}, headers=key)
            assert first.status_code == 200
            r = await u.post("/v1/agents/echo/invoke", json={"message": "two", "session": "a"}, headers=key)
            assert r.status_code == 422 and "different request" in r.json()["detail"]
        # The same key from bob's side is bob's own turn, not a replay of ada's.
        r = await c.post("/v1/agents/echo/invoke", json={"message": "one", "user": "bob", "session": "a"}, headers=key)
        assert r.status_code == 200 and r.json()["turn_id"] != first.json()["turn_id"]


def test_every_route_refuses_an_end_user_token_but_its_own(live, store: Store, acme: str):
    """Walks every declared route: an end-user token gets 403 from each route not declared for end-users, and from
    each end-user route that names another user or agent, before any handler runs (nothing is made)."""
    from moorage.api.routes import all_endpoints

    principal = store.authenticate(acme)
    token = live.app.state.moorage.auth.issue_user_token(principal, "echo", "ada").token
    ts = store.tenant(principal)

    def path_of(template: str, agent: str, user: str) -> str:
        out = template.replace("{agent}", agent).replace("{user}", user).replace("{path:path}", "x")
        while "{" in out:
            start, end = out.index("{"), out.index("}")
            out = out[:start] + "some-id" + out[end + 1:]
        return out

    tried = 0
    with live.client(token) as u:
        for ep in all_endpoints():
            if ep.auth != "tenant":
                continue
            targets = [("echo", "ada")] if not ep.end_user else \
                [(a, usr) for a, usr in (("echo", "bob"), ("other", "ada")) if "{agent}" in ep.path and a != "echo"
                 or "{user}" in ep.path and usr != "ada"]
            for agent, user in targets:
                r = u.request(ep.method, path_of(ep.path, agent, user),
                              json={} if ep.method in ("POST", "PUT", "PATCH") else None)
                assert r.status_code == 403 and r.json()["type"].endswith("/tenant-scope"), (ep.method, ep.path, r.text)
                tried += 1
    assert tried > 80
    # Nothing was made by any of them: no agent, no key.
    assert ts.agents.list() == [] and len(list(store.backend.list_api_keys(principal.tenant_id))) == 1


async def test_a_cancelled_request_gives_its_place_back(live_rt, runtime, acme: str, tmp_path: Path):
    ctx = live_rt.app.state.moorage
    async with aclient(live_rt, acme) as c:
        token = await _setup(c, tmp_path, "ada")
    # In-process, so the request's task itself is cancelled (as a stopping server cancels it).
    transport = httpx.ASGITransport(app=live_rt.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://moorage",
                                 headers={"Authorization": f"Bearer {token}"}, timeout=60) as u:
        task = asyncio.create_task(u.post("/v1/agents/echo/invoke", json={"message": "slow"}))
        await _until(lambda: bool(ctx.end_user_requests))
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert ctx.end_user_requests == {}


async def test_the_per_end_user_limits_are_the_operators_to_set(runtime, store: Store, tmp_path: Path):
    """``end_user_max_requests``, ``user_max_turns``, ``user_max_async_turns`` (moorage.toml or MOORAGE_*)."""
    from moorage import config as config_module
    from moorage.api import create_app
    from moorage.config import Config
    from moorage.webhooks.executions import ExecutionRunner

    cfg = config_module.load(env={"MOORAGE_DATA_DIR": str(tmp_path / "d"), "MOORAGE_END_USER_MAX_REQUESTS": "5",
                                  "MOORAGE_USER_MAX_TURNS": "6", "MOORAGE_USER_MAX_ASYNC_TURNS": "7"})
    assert (cfg.end_user_max_requests, cfg.user_max_turns, cfg.user_max_async_turns) == (5, 6, 7)
    assert create_app(store, cfg).state.moorage.max_end_user_requests == 5
    # A runtime's own reach its router and its async turns.
    from moorage.runtime.runtime import Runtime

    own = Runtime(cfg, store, runtime.driver, runtime.llm, runtime.instances)
    try:
        assert own.router.max_user_pending == 6 and ExecutionRunner.of(own).max_user_executions == 7
    finally:
        await own.aclose()
    assert runtime.router.max_user_pending == Config().user_max_turns == 128


async def test_crafted_cursors_are_refused_never_a_500(live_rt, acme: str, tmp_path: Path):
    import base64
    import json

    def cursor(position: Any) -> str:
        return base64.urlsafe_b64encode(json.dumps(position).encode()).decode().rstrip("=")

    async with aclient(live_rt, acme) as c:
        token = await _setup(c, tmp_path, "ada")
        assert (await c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"})).status_code == 200
    crafted = [{"o": 10 ** 30}, {"o": 2 ** 63}, {"after": 10 ** 30}, {"after": [10 ** 30, "x"]},
               {"before": [10 ** 30, "a", "b"]}, {"before": 10 ** 30}]
    async with aclient(live_rt, token) as u:
        for path in ("/v1/agents/echo/users/ada/events", "/v1/agents/echo/users/ada/facts",
                     "/v1/agents/echo/users/ada/facts/pending", "/v1/agents/echo/sessions"):
            for position in crafted:
                r = await u.get(path, params={"cursor": cursor(position)})
                assert r.status_code in (400, 422) and "malformed cursor" in r.json()["detail"], (path, position, r.text)
            # JSON's non-numbers too (Python's json reads them).
            raw = base64.urlsafe_b64encode(b'{"o": NaN}').decode().rstrip("=")
            assert (await u.get(path, params={"cursor": raw})).status_code in (400, 422)
            assert (await u.get(path)).status_code == 200
