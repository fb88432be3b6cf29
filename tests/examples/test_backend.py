"""examples/backend run as its README says (`moorage up` and the backend, two commands), end to end: sign-up, an
end-user token used against moorage as the page uses it, a streamed turn, an async turn whose result comes back by
signed webhook (once, however often it is asked or delivered), a sandbox exec, usage and a cap, and forget."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from moorage import Client
from moorage.client import AuthError, NotFound
from moorage.devservices.fleet import LocalHost
from moorage.devservices.postgres import free_port
from tests.cli.test_docs_commands import fenced_blocks

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "examples" / "backend" / "README.md"


def _commands() -> tuple[dict[str, str], list[str]]:
    """The README's two commands: the env `moorage up` is started with, and the backend's command line."""
    block = next(body for lang, body in fenced_blocks(README.read_text()) if lang == "bash")
    up, backend = [line.strip() for line in block.splitlines() if line.strip()]
    words = shlex.split(up.rstrip("&"))
    assert words[-2:] == [".venv/bin/moorage", "up"], up
    env = dict(w.split("=", 1) for w in words[:-2])
    assert backend.endswith(".venv/bin/python examples/backend/app.py"), backend
    assert backend.startswith("MOORAGE_API_KEY=$(cat ~/.local/share/moorage/local-admin.key) "), backend
    return env, [sys.executable, str(ROOT / "examples" / "backend" / "app.py")]


class Backend:
    def __init__(self, host: LocalHost, port: int, state: Path, argv: list[str]) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.env = {**os.environ, "MOORAGE_API_URL": host.url, "MOORAGE_API_KEY": host.key,
                    "BACKEND_PORT": str(port), "BACKEND_STATE_DIR": str(state)}
        self.argv = argv
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        first = self.proc.stdout.readline() if self.proc.stdout else ""
        assert first.startswith(f"backend on {self.url}"), first + self.stop()

    def stop(self) -> str:
        self.proc.terminate()
        return self.proc.communicate(timeout=30)[0]


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalHost, Backend]]:
    env, argv = _commands()
    port = free_port()
    env = {k: v.replace("127.0.0.1:8002", f"127.0.0.1:{port}") for k, v in env.items()}
    root = tmp_path_factory.mktemp("backend")
    host = LocalHost("up", root / "data", {**env, "MOORAGE_LOG_LEVEL": "warning"}, start_timeout_s=120)
    try:
        backend = Backend(host, port, root / "state", argv)
        try:
            yield host, backend
        finally:
            backend.stop()
    finally:
        host.stop()


def _signup(backend: Backend, user: str, plan: str = "free") -> httpx.Client:
    c = httpx.Client(base_url=backend.url, timeout=120)
    r = c.post("/api/signup", json={"user": user, "plan": plan})
    assert r.status_code == 200 and r.json() == {"user": user, "plan": plan}, r.text
    return c


def _stream(token: dict, message: str, origin: str) -> tuple[str, dict, httpx.Headers]:
    """What page.html's streamTurn does: POST .../invoke?stream=true with the end-user token, events as they come."""
    words, done = [], {}
    with httpx.stream("POST", f"{token['moorage_url']}/v1/agents/{token['agent']}/invoke?stream=true",
                      json={"message": message}, timeout=120,
                      headers={"Authorization": f"Bearer {token['token']}", "Accept": "text/event-stream",
                               "Origin": origin}) as r:
        assert r.status_code == 200, r.read()
        event = ""
        for line in r.iter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                import json

                data = json.loads(line[5:])
                if event == "token":
                    words.append(data["data"])
                elif event == "done":
                    done = data
        return "".join(words), done, r.headers


def test_the_backend_signs_up_streams_runs_async_by_webhook_execs_caps_and_forgets(running) -> None:
    host, backend = running
    page = httpx.get(backend.url + "/", timeout=30)
    assert page.status_code == 200 and "invoke?stream=true" in page.text and "/api/token" in page.text

    ada = _signup(backend, "ada")
    assert _signup(backend, "ada").get("/api/me").json()["plan"] == "free"  # signing in again is the same user
    token = ada.post("/api/token").json()
    assert token["token"].startswith("mrgu_") and token["agent"] == "notes" and token["moorage_url"] == host.url

    text, done, _ = _stream(token, "buy milk", backend.url)
    assert text.strip() == done["reply"] == "noted (1 so far): buy milk", (text, done)
    # The token acts for ada alone: naming bob, or reading his things, is refused.
    _signup(backend, "bob")
    with Client(host.url, token["token"]) as as_ada:
        assert as_ada.whoami()["user"] == "ada"
        with pytest.raises(AuthError):
            as_ada.invoke("notes", "call mum", user="bob")
        with pytest.raises((AuthError, NotFound)):
            as_ada.list_events("notes", "bob")
        assert as_ada.invoke("notes", "call mum")["reply"] == "noted (2 so far): call mum"

    # An async turn, its result by webhook; the same request id again is the same turn.
    asked = ada.post("/api/ask", json={"message": "water plants", "request_id": "req-1"})
    again = ada.post("/api/ask", json={"message": "water plants", "request_id": "req-1"})
    assert asked.status_code == again.status_code == 202 and asked.json()["execution_id"] == again.json()["execution_id"]
    ex_id = asked.json()["execution_id"]
    deadline = time.time() + 60
    while (r := ada.get(f"/api/results/{ex_id}")).status_code != 200:
        assert time.time() < deadline, r.text
        time.sleep(0.2)
    assert r.json()["type"] == "execution.succeeded" and r.json()["reply"] == "noted (3 so far): water plants"
    assert _signup(backend, "bob").get(f"/api/results/{ex_id}").status_code == 404  # ada's, not bob's
    # A delivery that is not moorage's (no signature) is refused.
    forged = httpx.post(backend.url + "/hooks/moorage", content=b'{"type": "execution.succeeded", "data": {}}',
                        headers={"webhook-id": "msg_x", "webhook-timestamp": str(int(time.time())),
                                 "webhook-signature": "v1,AAAA"}, timeout=30)
    assert forged.status_code == 400

    ran = ada.post("/api/run", json={"code": "print(open('notes.txt').read())"})
    assert ran.status_code == 200 and ran.json()["stdout"].split("\n")[:3] == ["buy milk", "call mum", "water plants"], ran.text

    me = ada.get("/api/me").json()
    assert me["caps"]["compute_seconds_per_day"]["limit"] == 120 and me["instance"]["sandbox_id"], me
    assert 0 < me["caps"]["compute_seconds_per_day"]["used"] < 120 and me["usage"]["totals"]["wakes"] >= 1, me

    # A trial user's one-second cap: once used, a turn is moorage's 429 cap-exceeded, passed on with its wait.
    cy = _signup(backend, "cy", "trial")
    deadline = time.time() + 60
    while (r := cy.post("/api/ask", json={"message": "hello"})).status_code == 202:
        assert time.time() < deadline, "the trial cap never refused a turn"
        time.sleep(0.5)
    assert r.status_code == 429 and r.json()["code"] == "cap-exceeded" and r.json()["retry_after"] > 0, r.text
    assert "compute_seconds_per_day" in r.json()["error"], r.text
    cap = cy.get("/api/me").json()["caps"]["compute_seconds_per_day"]  # what the page shows agrees with the refusal
    assert cap["used"] >= cap["limit"] == 1, cap

    # Forget: the user and their results are gone, and the token the page held acts for no one.
    gone = ada.delete("/api/me")
    assert gone.status_code == 200 and gone.json() == {"forgotten": "ada", "deleted": True}, gone.text
    with Client(host.url, host.key) as admin:
        with pytest.raises(NotFound):
            admin.get_user("notes", "ada")
    with pytest.raises(AuthError) as stale:
        with Client(host.url, token["token"]) as as_ada:
            as_ada.invoke("notes", "still there?")
    assert stale.value.status == 401 and "forgotten" in stale.value.detail
    assert re.search(r"sign up first", ada.get("/api/me").text)
    # Signing up again with the same id is a new user: the old page's token does not act for them either.
    _signup(backend, "ada")
    with pytest.raises(AuthError):
        with Client(host.url, token["token"]) as as_ada:
            as_ada.invoke("notes", "is it me?")


def test_the_page_streams_a_turn_from_the_browser_with_its_end_user_token(running) -> None:
    """page.html in Chromium, on the backend's origin: sign up, then a turn streamed straight from moorage with the
    end-user token (a cross-origin fetch the origin named in `cors_origins` may make), then one by webhook."""
    from playwright.sync_api import sync_playwright

    from tests.web.conftest import CHROMIUM, CHROMIUM_ARGS

    host, backend = running
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(backend.url + "/")
            page.fill("#user", "dora")
            page.click("#signup")
            page.wait_for_function("document.getElementById('status').textContent.includes('dora')")
            page.fill("#message", "feed the cat")
            page.click("#stream")
            page.wait_for_function("document.getElementById('reply').dataset.done !== undefined "
                                   "|| document.getElementById('reply').textContent.includes('Error')", timeout=60_000)
            assert page.text_content("#reply").strip() == "noted (1 so far): feed the cat"
            page.fill("#message", "walk the dog")
            page.click("#ask")
            page.wait_for_function("document.getElementById('reply').dataset.done === 'noted (2 so far): walk the dog'"
                                   "|| document.getElementById('reply').textContent.includes('Error')", timeout=60_000)
            assert page.text_content("#reply") == "noted (2 so far): walk the dog"
        finally:
            browser.close()
    # An origin moorage was not told of gets no CORS answer: its pages cannot read moorage's answers.
    other = httpx.options(f"{host.url}/v1/agents/notes/invoke", timeout=30,
                          headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in other.headers, other.headers


def test_a_restarted_backend_keeps_its_one_webhook_and_verifies_with_the_secret_it_kept(running) -> None:
    host, backend = running
    backend.stop()
    backend.start()  # the same state directory: the secret it wrote before subscribing
    with Client(host.url, host.key) as admin:
        hooks = [h for h in admin.paginate(admin.list_webhooks, "notes") if h["url"] == backend.url + "/hooks/moorage"]
    assert len(hooks) == 1, hooks
    eve = _signup(backend, "eve")
    ex_id = eve.post("/api/ask", json={"message": "after the restart"}).json()["execution_id"]
    deadline = time.time() + 60
    while (r := eve.get(f"/api/results/{ex_id}")).status_code != 200:
        assert time.time() < deadline, r.text
        time.sleep(0.2)
    assert r.json()["reply"] == "noted (1 so far): after the restart"
