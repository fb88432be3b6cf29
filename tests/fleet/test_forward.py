"""Forwarding through a host that does not hold the instance: streamed turns arrive event by event while the turn
runs (native SSE and the OpenAI-compatible stream), with the caller's trace id; an app's WebSocket is relayed to
the owner both ways, closes cleanly from either side, keeps the message cap, and refuses other tenants, other users
and dead share links through the forwarding host as the owner does; one to an owner that freezes closes with 1012 once
its lease lapses."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import textwrap
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from moorage.cli.up import tar_dir
from moorage.config import Config
from moorage.secrets.keyring import _encode, new_key
from moorage.store import open_store
from tests.app.wsapp import agent_py
from tests.fleet.harness import Fleet

pytestmark = pytest.mark.timeout(600)

MAX_MESSAGE = 64 << 10

# A turn that streams "one", then waits until the test says (through the app: GET /release) before it streams
# "two" and ends: its first event can only reach the caller before the turn ends if it is forwarded as it comes.
# The app on port 8080 also speaks WebSocket (tests/app/wsapp.py: the standard library only).
AGENT_PY = agent_py(r'''
import asyncio, json, os, struct

RELEASED = "/work/released"
CLOSES = "/work/last-close"
FLOODED = [0]  # how many messages of the last flood the app has written so far


class Handler(AppHandler):
    def respond(self):
        if self.upgrade():
            # Headers of its own on the 101 (a cookie too, which no caller gets), and chat.v1 when offered.
            chosen = b"Sec-WebSocket-Protocol: chat.v1\r\n" if "chat.v1" in self.offered() else b""
            self.switch(b"X-App-Header: from-app\r\nSet-Cookie: s=1\r\n" + chosen)
            self.custom = self.headers.get("x-custom")
            return self.serve_socket()
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        if self.target.startswith("/release"):
            open(RELEASED, "w").write("yes")
        out = json.dumps({"path": self.target, "body": len(body)}).encode()
        self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                         b"X-Seen: a\r\nX-Seen: b\r\nConnection: close\r\n\r\n" % len(out) + out)

    def serve_socket(self):
        while True:
            opcode, data = self.read_frame()
            if opcode is None:
                return
            if opcode == 8:  # the caller's close: remember its code, answer it
                open(CLOSES, "w").write(str(struct.unpack("!H", data[:2])[0]) if len(data) >= 2 else "none")
                self.frame(8, data[:2])
                return
            if opcode == 9:
                self.frame(10, data)
            elif opcode == 2:
                self.frame(2, data)
            elif data == b"custom":
                self.frame(1, json.dumps(self.custom).encode())
            elif data == b"last-close":
                self.frame(1, open(CLOSES).read().encode() if os.path.exists(CLOSES) else b"none")
            elif data.startswith(b"flood "):  # n messages of size bytes, as fast as the socket takes them
                n, size = map(int, data[6:].split())
                for i in range(n):
                    self.frame(2, i.to_bytes(4, "big") + b"f" * (size - 4))
                    FLOODED[0] = i + 1
            elif data == b"flooded":
                self.frame(1, str(FLOODED[0]).encode())
            elif data == b"close":
                self.frame(8, struct.pack("!H", 4000) + b"bye" + b"." * 120)  # the longest reason: 123 bytes
                self.read_frame()
                return
            else:
                self.frame(1, data)


serve(Handler)


async def on_message(ctx, message):
    if message != "stream":
        return "ok"
    if os.path.exists(RELEASED):
        os.remove(RELEASED)
    await ctx.emit("token", {"text": "one"})
    for _ in range(1200):  # at most a minute: a caller that never saw "one" never releases the turn
        if os.path.exists(RELEASED):
            break
        await asyncio.sleep(0.05)
    released = os.path.exists(RELEASED)
    await ctx.emit("token", {"text": "two"})
    return "released" if released else "never released"
''')


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, pg_cluster, seaweedfs, s3_bucket) -> Iterator[Fleet]:  # noqa: ANN001
    base = tmp_path_factory.mktemp("forward")
    # Hosts of one fleet share the end-user token secret (docs/api.md) and the secrets key (a share link made on
    # one host opens on every host).
    token_secret = secrets.token_urlsafe(32)
    for i in (1, 2, 3):
        (base / f"h{i}" / "api").mkdir(parents=True, mode=0o700)
        (base / f"h{i}" / "api" / "token-secret").write_text(token_secret)
        (base / f"h{i}" / "api" / "token-secret").chmod(0o600)
    f = Fleet(base, pg_cluster.create_database("forward"), seaweedfs.settings(s3_bucket, f"fleet-{base.name}"),
              secrets_keys=_encode(*new_key()), app_ws_max_message_bytes=str(MAX_MESSAGE))
    agent = base / "fw"
    agent.mkdir()
    (agent / "moorage.toml").write_text('[agent]\nname = "fw"\nentry = "agent.py"\nports = [8080]\n'
                                        '[agent.lifecycle]\nusers = "auto"\nsleep = "fixed:3600"\n')
    (agent / "agent.py").write_text(textwrap.dedent(AGENT_PY))
    try:
        r = f.api[0].post("/v1/agents/fw/deployments", content=tar_dir(agent), headers={"Content-Type": "application/gzip"})
        assert r.status_code == 201, r.text
        for user in ("ada", "bob"):  # both awake on h1: the other hosts forward to it
            r = f.api[0].post("/v1/agents/fw/invoke", json={"message": "hi", "user": user})
            assert r.status_code == 200 and r.json()["reply"] == "ok", r.text
        assert {f.records()[u].host for u in ("ada", "bob")} == {"h1"}
        yield f
    finally:
        f.close()


def _sse(lines: Iterator[str]) -> Iterator[tuple[str, Any]]:
    """(event, data) of each server-sent event, as it arrives."""
    event, data = "message", []
    for line in lines:
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())
        elif line == "" and data:
            text = "\n".join(data)
            yield event, (text if text == "[DONE]" else json.loads(text))
            event, data = "message", []


def _release(f: Fleet) -> None:
    # Through the third host (forwarded too), with a body the app must receive whole.
    r = f.api[2].post("/v1/agents/fw/users/ada/app/release", content=b"x" * 5000)
    assert r.status_code == 200, r.text
    assert r.json() == {"path": "/release", "body": 5000} and r.headers["x-moorage-served-by"] == "h1"
    assert r.headers.get_list("x-seen") == ["a", "b"]  # a repeated header stays repeated


def test_a_streamed_turn_through_another_host_arrives_event_by_event_with_the_callers_trace_id(fleet: Fleet) -> None:
    with fleet.api[1].stream("POST", "/v1/agents/fw/invoke", json={"message": "stream", "user": "ada"},
                             headers={"Accept": "text/event-stream"}) as r:
        assert r.status_code == 200 and r.headers["x-moorage-served-by"] == "h1"
        assert r.headers["content-type"].startswith("text/event-stream")
        trace_id = r.headers["x-trace-id"]
        events = _sse(r.iter_lines())
        first = next(events)
        # The turn is still waiting for the release, which only this first event triggers.
        assert first[0] == "token" and "one" in json.dumps(first[1])
        _release(fleet)
        rest = list(events)
    assert [e for e, _ in rest] == ["token", "done"] and "two" in json.dumps(rest[0][1])
    done = rest[-1][1]
    assert done["reply"] == "released"
    # The owner served the turn under the trace id the caller was given by the forwarding host.
    assert done["trace_id"] == trace_id
    for api in (fleet.api[0], fleet.api[1]):
        spans = api.get(f"/v1/traces/{trace_id}").json()["spans"]
        assert any(s["name"] == "POST /v1/agents/{agent}/invoke" for s in spans)
        assert len({s["trace_id"] for s in spans}) == 1 and len(spans) > 2  # the owner's turn spans too

    # The OpenAI-compatible stream, through the third host, the same way.
    with fleet.api[2].stream("POST", "/v1/chat/completions", headers={"X-Moorage-User": "ada"},
                             json={"model": "fw", "stream": True,
                                   "messages": [{"role": "user", "content": "stream"}]}) as r:
        assert r.status_code == 200 and r.headers["x-moorage-served-by"] == "h1"
        chunks = _sse(r.iter_lines())
        texts = []
        for _, data in chunks:
            texts.append(data["choices"][0]["delta"].get("content"))
            if texts[-1] == "one":
                break
        _release(fleet)
        rest = [d for _, d in chunks]
    assert [d["choices"][0]["delta"].get("content") for d in rest[:-2]] == ["two"]
    assert rest[-2]["choices"][0]["finish_reason"] == "stop" and rest[-1] == "[DONE]"

    # A plain (not streamed) answer comes back whole, as before.
    r = fleet.api[1].post("/v1/agents/fw/invoke", json={"message": "hi", "user": "ada"})
    assert r.status_code == 200 and r.json()["reply"] == "ok" and r.headers["x-moorage-served-by"] == "h1"
    assert r.headers["content-length"] == str(len(r.content))
    # The forwarding host's server says Date and Server once, as on any answer of its own.
    assert len(r.headers.get_list("date")) == 1 and len(r.headers.get_list("server")) == 1, r.headers


def _ws(f: Fleet, i: int, path: str) -> str:
    return f.hosts[i].url.replace("http://", "ws://") + path


async def _closed_with(ws: Any) -> tuple[int | None, str]:
    with pytest.raises(ConnectionClosed) as e:
        for _ in range(100):
            await asyncio.wait_for(ws.recv(), 60)
    rcvd = e.value.rcvd
    return (rcvd.code, rcvd.reason) if rcvd is not None else (None, "")


async def _refused(url: str, headers: dict[str, str] | None = None) -> int:
    with pytest.raises(InvalidStatus) as e:
        async with connect(url, additional_headers=headers or {}, open_timeout=120):
            pass
    return e.value.response.status_code


def test_an_app_websocket_through_another_host_is_relayed_to_its_owner(fleet: Fleet) -> None:
    auth = {"Authorization": f"Bearer {fleet.key}"}
    url = _ws(fleet, 1, "/v1/agents/fw/users/ada/app/ws")

    async def run() -> None:
        async with connect(url, additional_headers={**auth, "X-Custom": "kept"}, open_timeout=120) as ws:
            assert ws.response.headers["x-moorage-served-by"] == "h1"
            await ws.send("hello")
            assert await ws.recv() == "hello"
            blob = bytes(range(256)) * 200  # 50 KiB, under the cap
            await ws.send(blob)
            assert await ws.recv() == blob
            await ws.send("custom")
            assert json.loads(await ws.recv()) == "kept"
            await ws.send("close")  # the app closes: its code and reason reach the caller through both hosts
            assert await _closed_with(ws) == (4000, "bye" + "." * 120)
        async with connect(url, additional_headers=auth, open_timeout=120) as ws:  # the caller closes
            await ws.send("x")
            assert await ws.recv() == "x"
            await ws.close(4001, "done")
        async with connect(url, additional_headers=auth, open_timeout=120) as ws:
            for _ in range(50):
                await ws.send("last-close")
                if await ws.recv() == "4001":
                    break
                await asyncio.sleep(0.1)
            else:
                pytest.fail("the app never heard the caller's close")
            await ws.send(b"y" * (MAX_MESSAGE + 1))  # over the cap: closed 1009, by the forwarding host
            code, _ = await _closed_with(ws)
            assert code == 1009

        # A share link opens through any host; revoked, it is refused there too.
        link = fleet.api[0].post("/v1/agents/fw/users/ada/share-links", json={}).json()
        shared = _ws(fleet, 2, f"/v1/shared/{link['token']}/ws")
        async with connect(shared, open_timeout=120) as ws:
            assert ws.response.headers["x-moorage-served-by"] == "h1"
            await ws.send("via link")
            assert await ws.recv() == "via link"
        assert fleet.api[0].delete(f"/v1/agents/fw/users/ada/share-links/{link['id']}").status_code == 200
        assert await _refused(shared) == 404

    asyncio.run(run())


async def _last_close(url: str, headers: dict[str, str], want: str) -> str:
    """What the app last heard a caller close with (its code, or "none"), once it is ``want`` or after 5 s."""
    async with connect(url, additional_headers=headers, open_timeout=120) as ws:
        for _ in range(50):
            await ws.send("last-close")
            heard = await ws.recv()
            if heard == want:
                break
            await asyncio.sleep(0.1)
    return heard


def test_an_app_websocket_through_another_host_keeps_the_apps_handshake_and_a_close_without_code(fleet: Fleet) -> None:
    auth = {"Authorization": f"Bearer {fleet.key}"}
    url = _ws(fleet, 1, "/v1/agents/fw/users/ada/app/ws")

    async def run() -> None:
        async with connect(url, additional_headers=auth, subprotocols=["other", "chat.v1"], open_timeout=120) as ws:
            # The subprotocol the app chose and the headers of its 101, as the owner's host gives them.
            assert ws.subprotocol == "chat.v1"
            headers = ws.response.headers
            assert headers.get_all("x-app-header") == ["from-app"], headers
            assert "set-cookie" not in headers and headers.get_all("x-moorage-served-by") == ["h1"], headers
            await ws.send("x")
            assert await ws.recv() == "x"
        async with connect(url, additional_headers=auth, open_timeout=120) as ws:  # offered none: none chosen
            assert ws.subprotocol is None and ws.response.headers["x-app-header"] == "from-app"
            await ws.send("y")
            assert await ws.recv() == "y"
            await ws.close(4002)
        assert await _last_close(url, auth, "4002") == "4002"
        async with connect(url, additional_headers=auth, open_timeout=120) as ws:
            await ws.send("z")
            assert await ws.recv() == "z"
            no_code: Any = None  # an empty close frame: no status code at all (1005 is never sent)
            await ws.close(no_code)
        # The app got a close frame without a code, as on the owner's host, not one that says 1000.
        assert await _last_close(url, auth, "none") == "none"

    asyncio.run(run())


def test_a_redeploys_restart_reaches_a_socket_through_another_host_as_1012(fleet: Fleet, tmp_path: Path) -> None:
    def deploy(toml: str = "") -> None:
        agent = tmp_path / "fwre"
        agent.mkdir(exist_ok=True)
        (agent / "moorage.toml").write_text('[agent]\nname = "fwre"\nentry = "agent.py"\nports = [8080]\n'
                                            '[agent.lifecycle]\nusers = "auto"\nsleep = "fixed:3600"\n' + toml)
        (agent / "agent.py").write_text(textwrap.dedent(AGENT_PY))
        r = fleet.api[0].post("/v1/agents/fwre/deployments", content=tar_dir(agent),
                              headers={"Content-Type": "application/gzip"})
        assert r.status_code == 201, r.text

    deploy()
    r = fleet.api[0].post("/v1/agents/fwre/invoke", json={"message": "hi", "user": "ada"})  # awake on h1
    assert r.status_code == 200 and r.json()["reply"] == "ok", r.text
    auth = {"Authorization": f"Bearer {fleet.key}"}
    url = _ws(fleet, 1, "/v1/agents/fwre/users/ada/app/ws")

    async def run() -> None:
        async with connect(url, additional_headers=auth, open_timeout=120) as ws:
            assert ws.response.headers["x-moorage-served-by"] == "h1"
            await ws.send("v1")
            assert await ws.recv() == "v1"
            # Sandboxes of another environment (a network of their own): the instance restarts on the next load.
            deploy('[agent.network]\nallow = ["http://api.test:9"]\n')
            r = await asyncio.to_thread(fleet.api[0].post, "/v1/agents/fwre/invoke", json={"message": "hi", "user": "ada"})
            assert r.status_code == 200 and r.json()["reply"] == "ok", r.text
            assert await _closed_with(ws) == (1012, "the agent was redeployed; reconnect")
        async with connect(url, additional_headers=auth, open_timeout=120) as ws:
            await ws.send("v2")
            assert await ws.recv() == "v2"

    asyncio.run(run())


def test_other_tenants_and_users_are_refused_through_the_forwarding_host_too(fleet: Fleet) -> None:
    store = open_store(Config(store_url=fleet.store_url))
    try:
        globex = store.operator.create_tenant("globex-fw")[1].secret
    finally:
        store.close()
    bob_token = fleet.api[0].post("/v1/agents/fw/users/bob/tokens", json={}).json()["token"]
    ada = "/v1/agents/fw/users/ada/app/ws"

    async def run() -> None:
        for i in (1, 2):  # forwarding hosts
            assert await _refused(_ws(fleet, i, ada), {"Authorization": f"Bearer {globex}"}) == 404
            assert await _refused(_ws(fleet, i, ada), {"Authorization": f"Bearer {bob_token}"}) == 403
            assert await _refused(_ws(fleet, i, ada)) == 401
            assert await _refused(_ws(fleet, i, "/v1/shared/acme.0123456789abcdef0123456789abcdef.9999999999."
                                                "abcdefgh." + "A" * 43 + "/ws")) == 404
        # The owner refuses the same callers when the request claims to come from another host.
        forged = {"x-moorage-forwarded-by": "h2"}
        assert await _refused(_ws(fleet, 0, ada), {**forged, "Authorization": f"Bearer {globex}"}) == 404
        assert await _refused(_ws(fleet, 0, ada), {**forged, "Authorization": f"Bearer {bob_token}"}) == 403
        # Bob's own token reaches bob's app through the forwarding host.
        async with connect(_ws(fleet, 1, "/v1/agents/fw/users/bob/app/ws"),
                           additional_headers={"Authorization": f"Bearer {bob_token}"}, open_timeout=120) as ws:
            await ws.send("bob")
            assert await ws.recv() == "bob"

    asyncio.run(run())
    # Plain HTTP through a forwarding host: another tenant's key is a 404 for a turn and for the app.
    with httpx.Client(base_url=fleet.hosts[1].url, headers={"Authorization": f"Bearer {globex}"}, timeout=120) as c:
        assert c.post("/v1/agents/fw/invoke", json={"message": "hi", "user": "ada"}).status_code == 404
        assert c.get("/v1/agents/fw/users/ada/app/").status_code == 404


def test_a_detached_exec_is_followed_and_cancelled_through_another_host(fleet: Fleet) -> None:
    sid = fleet.records()["ada"].id
    script = "echo first; while [ ! -e go-$0 ]; do sleep 0.05; done; echo second"
    r = fleet.api[1].post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["sh", "-c", script, "a"], "detach": True,
                                                             "timeout_s": 60})
    assert r.status_code == 202 and r.headers["x-moorage-served-by"] == "h1", r.text
    exec_id = r.json()["id"]
    # Followed through a host that does not run it: "first" arrives while the command waits for the test.
    with fleet.api[2].stream("GET", f"/v1/executions/{exec_id}/output") as out:
        assert out.status_code == 200 and out.headers["x-moorage-served-by"] == "h1"
        events = _sse(out.iter_lines())
        first = next(events)
        assert first[0] == "output" and first[1]["text"] == "first\n"
        r = fleet.api[1].post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["touch", "go-a"]})
        assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
        rest = list(events)
    assert [(e, d.get("text") or d.get("status")) for e, d in rest] == [("output", "second\n"), ("end", "succeeded")]
    # A running exec is cancelled through any host.
    r = fleet.api[1].post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["sleep", "50"], "detach": True})
    assert r.status_code == 202, r.text
    r = fleet.api[2].post(f"/v1/executions/{r.json()['id']}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "cancelled" and r.headers["x-moorage-served-by"] == "h1"


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_caller_that_does_not_read_costs_the_hosts_no_memory(fleet: Fleet) -> None:
    auth = {"Authorization": f"Bearer {fleet.key}"}
    n, size = 1000, MAX_MESSAGE - 1024  # 63 MB the app sends to a caller that reads nothing for a while

    async def flooded() -> int:
        async with connect(_ws(fleet, 2, "/v1/agents/fw/users/ada/app/ws"), additional_headers=auth,
                           open_timeout=120) as other:
            await other.send("flooded")
            return int(await other.recv())

    async def run() -> None:
        pids = [fleet.hosts[0].proc.pid, fleet.hosts[1].proc.pid]  # the owner and the forwarding host
        async with connect(_ws(fleet, 1, "/v1/agents/fw/users/ada/app/ws"), additional_headers=auth,
                           open_timeout=120, max_queue=4) as ws:
            base = [_rss(p) for p in pids]
            peak = list(base)
            await ws.send(f"flood {n} {size}")
            # Until the app has written all it will write while nobody reads (the rest waits in the sandbox):
            # neither host holds the flood; each pulls messages only as the next one along takes them.
            seen = [-1, -2]
            while seen[-1] != seen[-2]:
                await asyncio.sleep(0.5)
                seen.append(await flooded())
                peak = [max(p, _rss(pid)) for p, pid in zip(peak, pids)]
            grown = [(p - b) >> 20 for p, b in zip(peak, base)]
            assert max(grown) < 16, f"the owner and the forwarding host grew by {grown} MiB"
            got = [await asyncio.wait_for(ws.recv(), 120) for _ in range(n)]
            assert [int.from_bytes(m[:4], "big") for m in got] == list(range(n))
            assert all(len(m) == size for m in got)

    asyncio.run(run())


def test_an_mcp_turn_through_another_host_is_served_by_the_owner(fleet: Fleet) -> None:
    headers = {"Accept": "application/json, text/event-stream", "MCP-Protocol-Version": "2025-11-25"}
    call = {"jsonrpc": "2.0", "id": 7, "method": "tools/call",
            "params": {"name": "send_message", "arguments": {"message": "hi", "user": "ada"}}}
    r = fleet.api[2].post("/mcp/fw", json=call, headers=headers)
    assert r.status_code == 200 and r.headers["x-moorage-served-by"] == "h1", r.text
    result = r.json()["result"]
    assert not result.get("isError") and result["content"][0]["text"] == "ok", result


def test_an_async_turn_through_another_host_runs_on_the_owner(fleet: Fleet) -> None:
    r = fleet.api[1].post("/v1/agents/fw/invoke?async=true", json={"message": "hi", "user": "ada"})
    assert r.status_code == 202 and r.headers["x-moorage-served-by"] == "h1", r.text
    for _ in range(600):
        ex = fleet.api[2].get(f"/v1/executions/{r.json()['id']}").json()
        if ex["status"] not in ("queued", "running"):
            break
        time.sleep(0.1)
    assert ex["status"] == "succeeded" and ex["reply"] == "ok", ex


def test_an_app_websocket_through_another_host_closes_1012_once_its_frozen_owners_lease_lapses(fleet: Fleet) -> None:
    """Last in this file: it freezes h2 (SIGSTOP, its connections open). The socket through h1 to cy's app on h2
    is closed with 1012 once h2's lease lapses (4 s here), not when its pings run out (40 s); connected again, cy's
    app is served by the host that takes cy over."""
    r = fleet.api[1].post("/v1/agents/fw/invoke", json={"message": "hi", "user": "cy"})
    assert r.status_code == 200 and fleet.records()["cy"].host == "h2", r.text
    auth = {"Authorization": f"Bearer {fleet.key}"}
    url = _ws(fleet, 0, "/v1/agents/fw/users/cy/app/ws")
    h2 = fleet.hosts[1]

    async def run() -> None:
        async with connect(url, additional_headers=auth, open_timeout=120) as ws:
            assert ws.response.headers["x-moorage-served-by"] == "h2"
            await ws.send("before")
            assert await ws.recv() == "before"
            os.killpg(h2.proc.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            try:
                code, reason = await _closed_with(ws)
                waited = time.monotonic() - t0
                assert code == 1012 and "connect again" in reason, (code, reason)
                assert waited < 15, waited  # the lease (4 s) and a heartbeat, not the pings' 40 s
                async with connect(url, additional_headers=auth, open_timeout=120) as again:
                    assert again.response.headers.get("x-moorage-served-by") != "h2"
                    await again.send("after")
                    assert await again.recv() == "after"
            finally:
                os.killpg(h2.proc.pid, signal.SIGCONT)

    asyncio.run(run())
    assert fleet.records()["cy"].host in ("h1", "h3")
