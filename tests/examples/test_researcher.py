"""examples/researcher deployed to a real `moorage up` (process driver) and driven only through the SDK and HTTP:
working memory across turns, episodic notes and a search, facts learned, confirmed, superseded and read as of a
past time, a durable research workflow whose search goes through the host's egress with a secret the sandbox
never sees and which waits for a human answer, the agent's own page, a background process found again (or, once
the instance slept, started again) on later turns, and a checkpoint the agent takes of itself, rolled back to."""

from __future__ import annotations

import http.server
import json
import shutil
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from moorage import Client
from moorage.client import BadRequest
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
    learned = _say(sdk, "learn city Oslo")
    assert learned["status"] == "pending", learned
    assert _say(sdk, "facts") == {}
    pending = sdk.list_pending_facts("researcher", "ada")["data"]
    assert [(f["value"], f["id"]) for f in pending] == [("Oslo", learned["id"])], pending  # the agent can name it
    sdk.confirm_fact("researcher", "ada", learned["id"])
    assert _say(sdk, "facts") == {"city": "Oslo"}
    oslo_time = time.time()
    time.sleep(0.05)
    sdk.confirm_fact("researcher", "ada", _say(sdk, "learn city Porto")["id"])
    assert _say(sdk, "facts") == {"city": "Porto"}
    porto = _say(sdk, "fact city")
    listed = sdk.list_facts("researcher", "ada", attribute="city")["data"]
    assert porto["value"] == "Porto" and [f["id"] for f in listed] == [porto["id"]], (porto, listed)
    assert _say(sdk, f"facts {oslo_time}") == {"city": "Oslo"}
    assert _say(sdk, f"facts known {oslo_time}") == {"city": "Oslo"}


def test_a_research_workflow_searches_with_a_hidden_secret_waits_for_a_human_and_serves_its_report(up) -> None:
    host, sdk, api = up
    turn = sdk.invoke("researcher", f"research solar storms {api.url}", user="bob")
    assert turn["status"] == "waiting", turn
    assert turn["interrupt"]["question"] == "Write a report on 'solar storms' from 2 results?", turn
    assert api.seen == [("/search?q=solar+storms", SECRET)], api.seen  # the host added the key on the way out
    waiting = sdk.list_workflows(agent="researcher", user="bob", status="waiting")["data"]
    assert [r["id"] for r in waiting] == [turn["run_id"]], waiting  # bob's turn waiting for an answer, and only his
    with pytest.raises(BadRequest):
        sdk.list_workflows(user="bob")  # a user is one agent's
    sid = sdk.get_user("researcher", "bob")["instance"]["sandbox_id"]
    out = sdk.exec(sid, ["sh", "-c", "env; cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'"])
    assert SECRET not in out["stdout"], "the secret reached the sandbox"

    done = sdk.answer(turn["run_id"], "yes")
    assert done["reply"] == "wrote solar-storms.md", done
    assert len(api.seen) == 1, api.seen  # resumed after the answer: the journaled search did not run again
    steps = [s["name"] for s in sdk.get_workflow(turn["run_id"])["steps"]]
    assert steps[:2] == ["plan", "search"] and "write" in steps, steps
    assert any("solar-storms.md" in h["event"]["content"]
               for h in sdk.search_events("researcher", "bob", "report on solar storms")["data"])

    page = httpx.get(f"{host.url}/v1/agents/researcher/users/bob/app/reports.json",
                     headers={"Authorization": f"Bearer {host.key}"}, timeout=60)
    assert page.status_code == 200 and page.json() == ["solar-storms.md"], page.text
    assert sdk.invoke("researcher", f"research tides {api.url}", user="carol")["status"] == "waiting"
    assert sdk.list_workflows(agent="researcher", user="bob", status="waiting")["data"] == []  # carol's is not his
    assert len(sdk.list_workflows(agent="researcher", user="carol", status="waiting")["data"]) == 1
    other = httpx.get(f"{host.url}/v1/agents/researcher/users/carol/app/reports.json",
                      headers={"Authorization": f"Bearer {host.key}"}, timeout=60)
    assert other.json() == [], other.text  # another user's page is their own


def test_a_background_process_is_found_again_and_started_again_after_a_sleep(up) -> None:
    host, sdk, _ = up
    started = _say(sdk, "watch", user="dan")
    assert started["watcher"] == "started" and started["pid"] > 1, started
    time.sleep(1.0)
    running = _say(sdk, "watch", user="dan")
    assert running == {"watcher": "running", "pid": started["pid"], "ticks": running["ticks"]}, running
    assert running["ticks"] >= 2, running  # the turn that started it ended; it kept going
    sid = sdk.get_user("researcher", "dan")["instance"]["sandbox_id"]
    sdk.sandbox_action(sid, "sleep")
    assert sdk.get_sandbox(sid)["state"] == "sleeping"
    sdk.sandbox_action(sid, "wake")
    # The process driver keeps files, not processes, across a sleep (docs/sandbox.md): the agent starts it again.
    again = _say(sdk, "watch", user="dan")
    assert again["watcher"] == "restarted" and again["was"] == running["pid"], again
    time.sleep(1.0)
    assert _say(sdk, "watch", user="dan")["watcher"] == "running"
    sdk.sandbox_action(sid, "sleep")  # the page comes back with the agent module, woken by its first request
    page = httpx.get(f"{host.url}/v1/agents/researcher/users/dan/app/", headers={"Authorization": f"Bearer {host.key}"},
                     timeout=60)
    assert page.status_code == 200 and "<h1>Reports</h1>" in page.text, page.text


def test_the_agent_checkpoints_itself_and_is_rolled_back_to_it(up) -> None:
    _, sdk, api = up
    sdk.answer(sdk.invoke("researcher", f"research coral reefs {api.url}", user="eve")["run_id"], "yes")
    cp = _say(sdk, "checkpoint before-kelp", user="eve")
    assert cp["name"] == "before-kelp", cp
    turn = sdk.invoke("researcher", f"research kelp forests {api.url}", user="eve")
    sdk.answer(turn["run_id"], "yes")
    assert _say(sdk, "report", user="eve") == ["coral-reefs.md", "kelp-forests.md"]

    sdk.rollback_checkpoint("researcher", "eve", cp["id"])
    assert _say(sdk, "report", user="eve") == ["coral-reefs.md"]
    names = [c["name"] for c in sdk.list_checkpoints("researcher", "eve")["data"]]
    assert "before-kelp" in names, names


def test_a_redeploy_reaches_the_page_of_a_user_whose_agent_is_awake(up, tmp_path: Path) -> None:
    """The dev loop: change the page, deploy again, reload it. Its server, started when the module was loaded, held
    the port, so the page stayed the old code's (the turns were the new code's) until the sandbox restarted."""
    host, sdk, _ = up
    url = f"{host.url}/v1/agents/researcher/users/fay/app/"
    auth = {"Authorization": f"Bearer {host.key}"}
    assert _say(sdk, "report", user="fay") == []
    assert "<p>v2</p>" not in httpx.get(url, headers=auth, timeout=60).text
    v2 = tmp_path / "researcher"
    shutil.copytree(AGENT, v2)
    code = (v2 / "agent.py").read_text()
    (v2 / "agent.py").write_text(code.replace("<h1>Reports</h1>", "<h1>Reports</h1><p>v2</p>"))
    try:
        sdk.deploy("researcher", str(v2))
        assert _say(sdk, "report", user="fay") == []  # the first turn of the new deployment
        page = httpx.get(url, headers=auth, timeout=60)
        assert page.status_code == 200 and "<h1>Reports</h1><p>v2</p>" in page.text, page.text
    finally:
        sdk.deploy("researcher", str(AGENT))
    assert "<p>v2</p>" not in httpx.get(url, headers=auth, timeout=60).text  # and back: the page of the live code
