"""A built-in-loop turn whose host is SIGKILLed after a tool returned: on recovery the tool is not called again.

A real `moorage up` host (process sandboxes, SQLite, its own data dir) serves a no-code agent whose tool appends
a line to a file on the sandbox's disk. The model is a scripted OpenAI-wire server on 127.0.0.1: its first
answer asks for the tool, and it holds the second request (the one made after the tool's result came back)
until the test has killed the host. A new host on the same data dir recovers the turn: the journaled model
output and tool result replay, the model is asked once more with the same input, and the tool ran once.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from moorage.cli.up import tar_dir
from moorage.config import Config
from moorage.devservices.postgres import free_port
from moorage.durable import DurableEngine
from moorage.store import open_store
from tests.lifecycle.crash_up import Up, stop_sandboxes

MODEL = "scripted-model"

TOOLS = '''
import os


def book(city: str) -> dict:
    """Book a trip to a city."""
    # A side effect on the sandbox's own disk, one line per call, on disk before the tool returns.
    with open("bookings.txt", "a") as f:
        f.write(city + "\\n")
        f.flush()
        os.fsync(f.fileno())
    with open("bookings.txt") as f:
        return {"booked": city, "ref": len(f.read().splitlines())}
'''


class _Model(BaseHTTPRequestHandler):
    """OpenAI chat/completions: 1st request asks for ``book``, 2nd is held until released, later ones answer."""

    lock = threading.Lock()
    requests: list[dict[str, Any]] = []
    second_arrived = threading.Event()
    release = threading.Event()

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
        with self.lock:
            self.requests.append(body)
            n = len(self.requests)
        if n == 1:
            message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "book", "arguments": json.dumps({"city": "Bergen"})}}]}
        else:
            if n == 2:
                self.second_arrived.set()
                self.release.wait(timeout=120)  # the host that asked is SIGKILLed meanwhile
            message = {"role": "assistant", "content": "Booked Bergen."}
        data = json.dumps({"id": "chatcmpl-" + uuid.uuid4().hex[:12], "object": "chat.completion", "created": 0,
                           "model": MODEL, "choices": [{"index": 0, "message": message,
                                                        "finish_reason": "tool_calls" if message.get("tool_calls") else "stop"}],
                           "usage": {"prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25}}).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            pass  # the killed host's connection is gone

    def log_message(self, *a: object) -> None:
        pass


@pytest.fixture
def model() -> Iterator[str]:
    _Model.requests = []
    _Model.second_arrived, _Model.release = threading.Event(), threading.Event()
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Model)
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1"
    _Model.release.set()
    srv.shutdown()


def bookings(data: Path) -> list[str]:
    lines: list[str] = []
    for f in (data / "sandboxes").glob("*/layer/work/bookings.txt"):
        lines += f.read_text().splitlines()
    return lines


@pytest.mark.timeout(300)
def test_tool_is_not_called_again_when_the_turn_is_recovered(tmp_path: Path, model: str) -> None:
    agent = tmp_path / "travel"
    agent.mkdir()
    (agent / "moorage.toml").write_text('[agent]\nname = "travel"\nsystem_prompt = "You book trips."\n'
                                        'tools = ["tools.py:book"]\n[agent.lifecycle]\nusers = "auto"\n')
    (agent / "tools.py").write_text(TOOLS)
    data = tmp_path / "data"
    server = Up(data, free_port(), MOORAGE_LLM_PROVIDER="openai", MOORAGE_LLM_BASE_URL=model,
                MOORAGE_LLM_API_KEY="sk-test", MOORAGE_LLM_MODEL=MODEL, MOORAGE_LOG_LEVEL="warning")
    invoke = {"user": "ada", "session": "s", "message": "Book me a trip to Bergen."}
    try:
        server.start()
        headers = {"Authorization": f"Bearer {server.key}"}
        r = httpx.post(f"{server.url}/v1/agents/travel/deployments", content=tar_dir(agent),
                       headers={**headers, "Content-Type": "application/gzip"}, timeout=300)
        assert r.status_code in (200, 201), r.text

        # The turn starts; its caller loses the connection when the host dies.
        first: dict[str, Any] = {}

        def call() -> None:
            try:
                first["response"] = httpx.post(f"{server.url}/v1/agents/travel/invoke", json=invoke,
                                               headers={**headers, "Idempotency-Key": "trip-1"}, timeout=200)
            except httpx.HTTPError as e:
                first["error"] = e

        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        # The second model request is made only after the tool returned and its result was journaled.
        assert _Model.second_arrived.wait(timeout=200), server.log.read_text()[-3000:]
        assert bookings(data) == ["Bergen"]
        server.kill()
        _Model.release.set()
        caller.join(timeout=60)
        assert "response" not in first, "the turn answered although its host was killed"

        # A new host on the same data dir recovers the turn as it starts; the caller's retry gets its reply.
        server.start()
        deadline = time.monotonic() + 120
        while True:
            resp = httpx.post(f"{server.url}/v1/agents/travel/invoke", json=invoke,
                              headers={**headers, "Idempotency-Key": "trip-1"}, timeout=120)
            if resp.status_code == 200 or time.monotonic() > deadline:
                break
            assert resp.status_code in (409, 429, 503), resp.text
            time.sleep(0.2)
        assert resp.status_code == 200, resp.text
        assert resp.json()["reply"] == "Booked Bergen."
    finally:
        server.stop()
        stop_sandboxes(data)

    # The tool ran once; the model was asked three times: the first answer replayed from the journal, the
    # second asked again with the same input (the replayed tool result included), then nothing more.
    assert bookings(data) == ["Bergen"]
    assert len(_Model.requests) == 3
    assert _Model.requests[2]["messages"] == _Model.requests[1]["messages"]
    tool_msg = next(m for m in _Model.requests[2]["messages"] if m["role"] == "tool")
    assert json.loads(tool_msg["content"]) == {"booked": "Bergen", "ref": 1}

    store = open_store(Config(data_dir=data, sandbox_driver="process"))
    try:
        (ts,) = list(store.operator.tenants())
        (run,) = [r for r in ts.runs.list(limit=100) if r.name == "turn"]
        assert run.status == "succeeded"
        steps = [(h.name, h.status) for h in DurableEngine(ts).history(run.id) if h.kind == "step"]
        assert steps == [("model", "succeeded"), ("tool:book", "succeeded"), ("model", "succeeded")]
    finally:
        store.close()
