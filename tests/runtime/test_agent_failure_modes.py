"""Agent code that fails in ways other than exiting (tests/runtime/test_agent_exits.py), through `moorage up`.

- An exception whose text is huge (10 MB) left its turn unanswered for the whole 600 s, and the user's next turns
  queued behind it: the guest's error frame was over the channel's 8 MiB limit and was dropped. Its text is now cut.
- An exception whose ``str()`` itself raises, and ``SystemExit``/``KeyboardInterrupt`` raised by the agent's code,
  read as the guest's failure (no line of the agent's code; a SystemExit ended the guest's supervisor): they are now
  the agent's error, with where it was raised.
- A reply that is not JSON (a set) or over the frame limit said "result not JSON" or "exceeds the frame limit" with
  nothing to do: it now says what to return instead.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Iterator

import pytest

from moorage import Client
from moorage.client import ApiError
from moorage.devservices.fleet import LocalHost

AGENT = '''
import asyncio, sys, time

class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no text")

async def on_message(ctx, message):
    if message == "huge-error":
        raise ValueError("x" * (10 << 20))
    if message == "unprintable":
        raise Unprintable()
    if message == "sys-exit":
        sys.exit(4)
    if message == "interrupt":
        raise KeyboardInterrupt()
    if message == "set":
        return {"tags": {1, 2}}
    if message == "huge-reply":
        return "y" * (20 << 20)
    if message == "hang":
        await asyncio.sleep(3600)
    if message == "block":
        time.sleep(3600)
    return "ok " + message
'''
PLAIN = '''
import time

def on_message(ctx, message):
    if message == "block":
        time.sleep(3600)
    return "ok " + message
'''
BOUND_S = 3


def _agent(base, name: str, code: str) -> object:
    agent = base / name
    agent.mkdir()
    (agent / "moorage.toml").write_text(f'[agent]\nname = "{name}"\nentry = "agent.py"\n'
                                        '[agent.lifecycle]\nusers = "auto"\n')
    (agent / "agent.py").write_text(code)
    return agent


@pytest.fixture(scope="module", params=["process", "microvm"])
def host(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalHost]:
    tmp = tmp_path_factory.mktemp(f"failures-{request.param}")
    env = {"MOORAGE_TEST_IMAGES_DIR": os.environ.get("MOORAGE_TEST_IMAGES_DIR", "/var/tmp/moorage-images"),
           "MOORAGE_LOG_LEVEL": "info"}
    h = LocalHost(f"failures-{request.param}", tmp / "data", env, driver=request.param, start_timeout_s=600)
    try:
        with Client(h.url, h.key) as sdk:
            sdk.deploy("frail", _agent(tmp, "frail", AGENT))
            sdk.deploy("plain", _agent(tmp, "plain", PLAIN))
        yield h
    finally:
        h.stop()


def _fails(sdk: Client, agent: str, message: str, user: str) -> tuple[ApiError, float]:
    started = time.monotonic()
    with pytest.raises(ApiError) as failed:
        sdk.invoke(agent, message, user=user)
    return failed.value, time.monotonic() - started


def test_an_exception_of_any_size_or_kind_is_the_agent_s_error_and_the_next_turn_served(host: LocalHost) -> None:
    with Client(host.url, host.key, max_retries=0, timeout_s=120) as sdk:
        for message, raised in (("huge-error", "ValueError: xxx"), ("unprintable", "Unprintable: <its str() raised"),
                                ("sys-exit", "SystemExit: 4"), ("interrupt", "KeyboardInterrupt")):
            e, took = _fails(sdk, "frail", message, "ada")
            assert e.status == 502 and e.code == "agent-error", (message, e)
            assert e.detail.startswith(f"agent raised {raised}") and len(e.detail) < 10_000, (message, e.detail[:300])
            assert "agent.py, line" in (e.hint or ""), (message, e.hint)
            assert took < 30, f"{message}: answered after {took:.0f} s"
            assert sdk.invoke("frail", "after", user="ada")["reply"] == "ok after"


def test_a_reply_that_is_not_json_or_too_large_says_what_to_return(host: LocalHost) -> None:
    with Client(host.url, host.key, max_retries=0, timeout_s=120) as sdk:
        e, _ = _fails(sdk, "frail", "set", "cy")
        assert e.status == 502 and e.code == "agent-error", e
        assert "the agent returned a reply that is not JSON (Object of type set" in e.detail, e.detail
        assert "convert sets to lists" in (e.hint or ""), e.hint
        e, _ = _fails(sdk, "frail", "huge-reply", "cy")
        assert e.code == "agent-error" and "more than the" in e.detail and "ctx.files" in (e.hint or ""), e
        assert sdk.invoke("frail", "after", user="cy")["reply"] == "ok after"
