"""A deploy streams its build's progress (``Accept: text/event-stream`` / ``?stream=true``): ``progress`` events as the
template is built, then the ``deployment`` (or an ``error``); a caller that leaves does not cut the build; the SDK's
``deploy_stream`` and ``moorage deploy`` (its steps on stderr) read it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from moorage.client import ApiError, AsyncClient
from tests.api.conftest import aclient, agent_archive, sse_events

GZ = {"content-type": "application/gzip"}
STREAM = {**GZ, "accept": "text/event-stream"}


async def _events(c: httpx.AsyncClient, body: bytes, *, stop_after: int | None = None) -> list[tuple[str, Any]]:
    return await sse_events(c, "POST", "/v1/agents/echo/deployments", content=body, headers=STREAM,
                            stop_after=stop_after)


async def test_a_streamed_deploy_says_each_step_then_the_deployment(live_rt, acme: str, globex: str,
                                                                    tmp_path: Path) -> None:
    async with aclient(live_rt, acme) as c:
        events = await _events(c, agent_archive(tmp_path))
        kinds = [k for k, _ in events]
        assert kinds[-1] == "deployment" and set(kinds[:-1]) == {"progress"}, events
        steps = [d["message"] for k, d in events if k == "progress"]
        assert steps[0].startswith("starting a sandbox for the template") and steps[-1] == "template ready", steps
        dep = events[-1][1]
        assert dep["number"] == 1 and dep["status"] == "ready", dep
        r = await c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"})
        assert r.status_code == 200 and r.json()["reply"] == "echo: hi"

        # A build that fails says why in-band (the 200 was sent with the first step), and is listed failed.
        broken = agent_archive(tmp_path, "echo", "raise RuntimeError('bad import')\n", version="b")
        events = await _events(c, broken)
        assert events[-1][0] == "error" and events[-1][1]["type"] == "agent-load-failed", events
        assert "bad import" in events[-1][1]["detail"]
        listed = (await c.get("/v1/agents/echo/deployments")).json()["data"]
        assert [d["status"] for d in sorted(listed, key=lambda d: d["number"])] == ["ready", "failed"], listed

        # Refused before any build (not a package): a plain problem, not a stream.
        r = await c.post("/v1/agents/echo/deployments", content=b"not a tarball", headers=STREAM)
        assert r.status_code == 422 and r.headers["content-type"].startswith("application/problem+json")
    # Another tenant's key sees none of it and streams its own deploy of the same name.
    async with aclient(live_rt, globex) as c:
        assert (await c.get("/v1/agents/echo/deployments")).status_code == 404
        events = await _events(c, agent_archive(tmp_path, version="g"))
        assert events[-1][0] == "deployment" and events[-1][1]["number"] == 1


async def test_a_caller_that_leaves_mid_build_does_not_cut_it(live_rt, acme: str, tmp_path: Path) -> None:
    async with aclient(live_rt, acme) as c:
        first = await _events(c, agent_archive(tmp_path), stop_after=1)  # then the connection closes
        assert first[0][0] == "progress"
        deadline = time.monotonic() + 60
        while True:
            listed = (await c.get("/v1/agents/echo/deployments")).json()["data"] \
                if (await c.get("/v1/agents/echo")).status_code == 200 else []
            if [d["status"] for d in listed] == ["ready"]:
                break
            assert time.monotonic() < deadline, listed
            await asyncio.sleep(0.2)
        r = await c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"})
        assert r.status_code == 200 and r.json()["reply"] == "echo: hi"


async def test_the_sdk_streams_a_deploy(live_rt, acme: str, tmp_path: Path) -> None:
    async with AsyncClient(live_rt.url, acme) as sdk:
        events = [ev async for ev in sdk.deploy_stream("echo", agent_archive(tmp_path))]
        assert events[-1]["event"] == "deployment" and events[-1]["data"]["number"] == 1
        assert any(ev["event"] == "progress" and ev["data"]["message"] == "template ready" for ev in events)
        broken = agent_archive(tmp_path, "echo", "raise RuntimeError('bad import')\n", version="b")
        with pytest.raises(ApiError) as e:
            async for _ in sdk.deploy_stream("echo", broken):
                pass
        assert "bad import" in str(e.value)


async def test_a_streamed_deploys_idempotency_key_holds_until_the_build_ends_and_replays_its_answer(
        live_rt, acme: str, tmp_path: Path) -> None:
    """The SDK sends every deploy with an Idempotency-Key and retries one whose answer never came: the retry of a
    streamed deploy must not build again. While the build runs the key answers 409; once it ended, the JSON answer
    (201 and the deployment, or the build's problem) with ``Idempotent-Replayed``."""
    async with aclient(live_rt, acme) as c:
        body = agent_archive(tmp_path)
        key = {"Idempotency-Key": "deploy-once"}
        async with c.stream("POST", "/v1/agents/echo/deployments", content=body, headers={**STREAM, **key}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("event: progress"):
                    break  # the build is under way: the caller leaves, as a lost connection would
        during = await c.post("/v1/agents/echo/deployments", content=body, headers={**GZ, **key})
        assert during.status_code in (409, 201), during.text
        if during.status_code == 409:  # the build had not ended yet (the usual case)
            assert "in progress" in during.json()["detail"]
        deadline = time.monotonic() + 60
        while True:
            again = await c.post("/v1/agents/echo/deployments", content=body, headers={**STREAM, **key})
            if again.status_code != 409:
                break
            assert time.monotonic() < deadline, again.text
            await asyncio.sleep(0.2)
        assert again.status_code == 201 and again.headers["idempotent-replayed"] == "true", again.text
        assert again.json()["number"] == 1 and again.json()["status"] == "ready"
        listed = (await c.get("/v1/agents/echo/deployments")).json()["data"]
        assert [d["number"] for d in listed] == [1], listed  # built once
        # The SDK's retry of a streamed deploy gets the replay as its one `deployment` event.
        async with AsyncClient(live_rt.url, acme) as sdk:
            events = [ev async for ev in sdk.deploy_stream("echo", body, idempotency_key="deploy-once")]
        assert [ev["event"] for ev in events] == ["deployment"] and events[0]["data"]["number"] == 1

        # A build that fails keeps its problem under the key: the retry is told, and builds nothing.
        broken = agent_archive(tmp_path, "echo", "raise RuntimeError('bad import')\n", version="b")
        bad = {"Idempotency-Key": "deploy-broken"}
        async with c.stream("POST", "/v1/agents/echo/deployments", content=broken, headers={**STREAM, **bad}) as r:
            assert r.status_code == 200 and "agent-load-failed" in (await r.aread()).decode()
        for _ in range(300):
            replay = await c.post("/v1/agents/echo/deployments", content=broken, headers={**GZ, **bad})
            if replay.status_code != 409:
                break
            await asyncio.sleep(0.1)
        assert replay.status_code == 422 and replay.json()["type"].endswith("/agent-load-failed"), replay.text
        assert replay.headers["idempotent-replayed"] == "true"
        listed = (await c.get("/v1/agents/echo/deployments")).json()["data"]
        assert sorted(d["number"] for d in listed) == [1, 2], listed

