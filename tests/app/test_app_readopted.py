"""A micro-VM whose processes outlived the host process that started them (left running by `moorage up --detach`
and re-adopted, or asleep in a snapshot an earlier host made) and whose agent was redeployed since: its first app
request serves the new deployment's page, not the old code's app still listening in the guest."""

from __future__ import annotations

import io
import os
import tarfile
import textwrap
import time
from pathlib import Path

import pytest

from moorage.devservices.fleet import LocalHost

APP = '''
import http.server, threading

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"VERSION"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

def _serve():
    try:
        http.server.ThreadingHTTPServer(("127.0.0.1", 8080), Handler).serve_forever()
    except OSError:
        pass

threading.Thread(target=_serve, daemon=True).start()

async def on_message(ctx, message):
    return "VERSION"
'''


def _agent(root: Path, version: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "moorage.toml").write_text('[agent]\nname = "web"\nentry = "agent.py"\nports = [8080]\n'
                                       '[agent.lifecycle]\nusers = "auto"\n')
    (root / "agent.py").write_text(textwrap.dedent(APP).replace("VERSION", version))
    return root


def _host(data: Path, **env: str) -> LocalHost:
    images = os.environ.get("MOORAGE_TEST_IMAGES_DIR", "/var/tmp/moorage-images")
    return LocalHost("up", data, {"MOORAGE_LOG_LEVEL": "warning", "MOORAGE_TEST_IMAGES_DIR": images, **env},
                     driver="microvm", start_timeout_s=600)


def _deploy_and_page(host: LocalHost, root: Path, version: str) -> str:
    with host.client(host.key) as c:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            for p in sorted(_agent(root, version).iterdir()):
                tar.add(p, arcname=p.name)
        r = c.post("/v1/agents/web/deployments", content=buf.getvalue(), headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        # Restarted for the new code, the app may still be binding its port: a 502 until it listens is fair (the
        # wait for it is the app path's own concern), the old code's page never is.
        deadline = time.monotonic() + 30
        while True:
            r = c.get("/v1/agents/web/users/ada/app/")
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            assert r.status_code == 502 and "app-unavailable" in r.text, r.text
            time.sleep(0.2)
        assert r.status_code == 200, r.text
        return r.text


@pytest.mark.timeout(900)
def test_the_first_app_request_after_a_host_restart_and_a_redeploy_serves_the_new_code(tmp_path: Path) -> None:
    data = tmp_path / "data"
    first = _host(data, MOORAGE_SHUTDOWN="detach")
    try:
        assert _deploy_and_page(first, tmp_path / "v1", "v1") == "v1"
    finally:
        code, _ = first.sigterm(120)  # detach: the micro-VM runs on, its app serving v1
    assert code == 0
    second = _host(data)  # re-adopts it
    try:
        assert _deploy_and_page(second, tmp_path / "v2", "v2") == "v2"
    finally:
        second.sigterm(120)  # sleep: the snapshot holds v2's code and app
    third = _host(data)
    try:
        assert _deploy_and_page(third, tmp_path / "v3", "v3") == "v3"
        with third.client(third.key) as c:
            assert c.post("/v1/agents/web/invoke", json={"message": "hi", "user": "ada"}).json()["reply"] == "v3"
    finally:
        third.stop()
        first.stop()  # whatever of the data directory's processes is left
