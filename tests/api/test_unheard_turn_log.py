"""A turn whose caller stopped listening runs on, durable; when it is then cancelled (its user forgotten, its key
revoked) the host's log said "Task exception was never retrieved" with the RunCancelled traceback, and "Task was
destroyed but it is pending" for the wait on its events. Through a real `moorage up`, whose log is read whole."""

from __future__ import annotations

import io
import tarfile
import threading
import time
from pathlib import Path

import httpx

from moorage import Client
from moorage.devservices.fleet import LocalHost

AGENT = '''
import asyncio

async def on_message(ctx, message):
    if message.startswith("sleep "):
        await ctx.emit("token", "thinking ")  # the stream's answer starts at once
        await asyncio.sleep(float(message.split()[1]))
    return "echo: " + message
'''


def _archive() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in (("moorage.toml", '[agent]\nname = "echo"\nentry = "agent.py"\n'
                                            '[agent.lifecycle]\nusers = "auto"\n'), ("agent.py", AGENT)):
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _stream(url: str, credential: str, body: dict[str, str], *, leave: bool) -> list[str]:
    """A streamed turn's lines: the caller leaves after the first token (``leave``), or reads to the end."""
    lines: list[str] = []
    with httpx.stream("POST", f"{url}/v1/agents/echo/invoke?stream=true", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {credential}", "accept": "text/event-stream"}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            lines.append(line)
            if leave and "thinking" in line:
                break
    return lines


def _wait_cancelled(sdk: Client, user: str) -> None:
    deadline = time.time() + 30
    while not sdk.list_workflows(agent="echo", user=user, status="cancelled")["data"]:
        assert time.time() < deadline, sdk.list_workflows(agent="echo", user=user)
        time.sleep(0.2)


def test_a_turn_cancelled_after_its_caller_left_leaves_no_unretrieved_task(tmp_path: Path) -> None:
    host = LocalHost("up", tmp_path / "data", {"MOORAGE_LOG_LEVEL": "info"}, start_timeout_s=120)
    try:
        with Client(host.url, host.key) as sdk:
            sdk.deploy("echo", _archive())
            sdk.put_user("echo", "ada")
            # A forgotten user: the browser left its stream, then the product forgets the user (the turn is cancelled).
            token = sdk.issue_user_token("echo", "ada")["token"]
            _stream(host.url, token, {"message": "sleep 30"}, leave=True)
            time.sleep(0.5)
            assert sdk.delete_user("echo", "ada")["deleted"] is True  # cancels the user's turns first

            # A revoked key: its stream is ended by the server (credential-ended), and its turn is cancelled.
            made = sdk.create_key(["invoke"], label="leaked")
            revoke = threading.Timer(2.0, sdk.revoke_key, args=(made["id"],))  # while its stream is open
            revoke.start()
            lines = _stream(host.url, made["secret"], {"message": "sleep 30", "user": "bob"}, leave=False)
            revoke.join()
            assert any("credential-ended" in line for line in lines), lines[-4:]
            _wait_cancelled(sdk, "bob")
            time.sleep(1)  # the cancelled tasks end and are collected
    finally:
        host.stop()
    log = host.log.read_text(errors="replace")
    assert "workflow run cancelled" in log  # the turns were cancelled, as the test means
    for line in ("Task exception was never retrieved", "Task was destroyed but it is pending"):
        assert line not in log, log[log.find(line) - 200: log.find(line) + 2000]

