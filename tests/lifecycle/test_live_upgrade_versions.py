"""A live upgrade's instances met a redeploy of their app: an app whose server the agent's module starts answers
with the new code right after a redeploy restarted it (bench/upgrade/run.py runs two real versions)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.runtime.test_product_path import Up, data  # noqa: F401 - ``data``: the fixture

AGENT_PY = '''\
import http.server, threading

VERSION = "{version}"


class Page(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = ("page " + VERSION).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _serve():
    try:
        http.server.ThreadingHTTPServer(("0.0.0.0", 8080), Page).serve_forever()
    except OSError:
        pass


threading.Thread(target=_serve, daemon=True).start()


async def on_message(ctx, message):
    if message == "spawn":
        return "spawned %d" % (await ctx.spawn(["sleep", "300"]))["pid"]
    try:
        n = int(ctx.files.read("counter.txt"))
    except Exception:
        n = 0
    ctx.files.write("counter.txt", str(n + 1))
    return "%s %d" % (VERSION, n + 1)
'''

def _agent(base: Path, version: str) -> Path:
    d = base / f"agent-{version}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "moorage.toml").write_text('[agent]\nname = "echo"\nentry = "agent.py"\nports = [8080]\n'
                                    '[agent.lifecycle]\nusers = "auto"\nsleep = "fixed:3600"\npool = 0\n')
    (d / "agent.py").write_text(AGENT_PY.format(version=version))
    return d


@pytest.mark.slow
def test_an_app_asked_right_after_a_redeploy_restarted_its_instance_answers_with_the_new_code(
        data: Path, tmp_path: Path) -> None:  # noqa: F811
    up = Up(data)
    try:
        up.deploy(_agent(tmp_path, "v1"))
        assert up.turn("ada", "hi") == "v1 1"
        assert up.api.get("/v1/agents/echo/users/ada/app/", timeout=60).text == "page v1"
        up.deploy(_agent(tmp_path, "v2"))
        # The turn loads v2, which restarts the instance (its app's server is v1's); its module starts v2's server,
        # which may still be binding its port when the app is asked (it was a 502 "not listening" then).
        assert up.turn("ada", "hi") == "v2 2"
        r = up.api.get("/v1/agents/echo/users/ada/app/", timeout=60)
        assert (r.status_code, r.text) == (200, "page v2"), r.text
        up.deploy(_agent(tmp_path, "v3"))  # and when the app is asked first, before any turn loads v3
        r = up.api.get("/v1/agents/echo/users/ada/app/", timeout=60)
        assert (r.status_code, r.text) == (200, "page v3"), r.text
    finally:
        up.stop()
