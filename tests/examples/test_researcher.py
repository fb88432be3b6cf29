"""examples/researcher deployed to a real `moorage up` (process driver) and driven only through the SDK and HTTP:
working memory across turns, episodic notes and a search, facts learned, confirmed, superseded and read as of a
past time, a durable research workflow whose search goes through the host's egress with a secret the sandbox
never sees and which waits for a human answer, the agent's own page, a background process found again (or, once
the instance slept, started again) on later turns, and a checkpoint the agent takes of itself, rolled back to."""

from __future__ import annotations

import http.server
import json
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from moorage import Client
from moorage.devservices.fleet import LocalHost

ROOT = Path(__file__).resolve().parents[2]
AGENT = ROOT / "examples" / "researcher"
SECRET = "k-research-7731"


class SearchApi:
    """The internet, as far as the agent is concerned: a search API that wants an X-Api-Key."""

    def __init__(self) -> None:
        seen = self.seen = []  # type: list[tuple[str, str | None]]

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                seen.append((self.path, self.headers.get("X-Api-Key")))
                ok = self.headers.get("X-Api-Key") == SECRET
                body = json.dumps({"results": ["paper A on " + self.path, "paper B"]} if ok else {}).encode()
                self.send_response(200 if ok else 401)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/search"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalHost, Client, SearchApi]]:
    api = SearchApi()
    host = LocalHost("up", tmp_path_factory.mktemp("researcher") / "data",
                     {"MOORAGE_EGRESS_ALLOW_CIDRS": "127.0.0.0/8", "MOORAGE_LOG_LEVEL": "warning"}, start_timeout_s=120)
    sdk = Client(host.url, host.key, timeout_s=300)
    try:
        sdk.deploy("researcher", str(AGENT))
        sdk.set_secret("researcher", "SEARCH_KEY", SECRET)
        yield host, sdk, api
    finally:
        sdk.close()
        host.stop()
        api.server.shutdown()


def _say(sdk: Client, text: str, user: str = "ada") -> object:
    turn = sdk.invoke("researcher", text, user=user, session="s1")
    assert turn["status"] == "done", turn
    reply = turn["reply"]
    return json.loads(reply) if isinstance(reply, str) and reply[:1] in "[{" else reply


def test_memory_working_episodic_and_semantic(up) -> None:
    _, sdk, _ = up
    first = _say(sdk, "note the climate papers of 2024")
    assert first["earlier_in_session"] == [], first
    second = _say(sdk, "note ocean heat content data")
    assert "the climate papers of 2024" in second["earlier_in_session"], second  # working memory, turn to turn
    assert "ocean heat content data" in _say(sdk, "recall ocean")
    hits = sdk.search_events("researcher", "ada", "climate papers")["data"]
    assert any("climate papers" in h["event"]["content"] for h in hits), hits

    # Facts: the agent learns, the product confirms, a new value supersedes it, and the old one is still there as of then.
    assert _say(sdk, "learn city Oslo")["status"] == "pending"
    assert _say(sdk, "facts") == {}
    pending = sdk.list_pending_facts("researcher", "ada")["data"]
    assert [f["value"] for f in pending] == ["Oslo"], pending
    sdk.confirm_fact("researcher", "ada", pending[0]["id"])
    assert _say(sdk, "facts") == {"city": "Oslo"}
    oslo_time = time.time()
    time.sleep(0.05)
    _say(sdk, "learn city Porto")
    sdk.confirm_fact("researcher", "ada", sdk.list_pending_facts("researcher", "ada")["data"][0]["id"])
    assert _say(sdk, "facts") == {"city": "Porto"}
    assert _say(sdk, f"facts {oslo_time}") == {"city": "Oslo"}
    assert _say(sdk, f"facts known {oslo_time}") == {"city": "Oslo"}
