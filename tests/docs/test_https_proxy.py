"""docs/operations.md, "Serve it over HTTPS": the page's nginx block as written (only its certificate, its listen
address and moorage's port changed) in front of a real `moorage up`. Through it: the SDK and the CLI with a private
CA (`SSL_CERT_FILE`), a deploy's progress, a turn's tokens as they come (not all at its end), an agent's app page and
its WebSocket both ways, and the dashboard."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest
from websockets.asyncio.client import connect

from moorage import Client
from moorage.devservices.postgres import free_port
from tests.app.wsapp import agent_py
from tests.tls import certificate
from tests.upproc import MOORAGE, ROOT, moorage_up

AGENT = agent_py(r'''
import asyncio


class Handler(AppHandler):
    def respond(self):
        if not self.upgrade():
            body = b"hello from the app"
            self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n"
                             b"Connection: close\r\n\r\n" % len(body) + body)
            return
        self.switch()
        self.echo_text()


serve(Handler)


async def on_message(ctx, message):
    await ctx.emit("token", "first ")
    await asyncio.sleep(2)  # the first token is through the proxy long before the turn ends
    await ctx.emit("token", "second")
    return "done: " + message
''')


def nginx_block() -> str:
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text.split("## Serve it over HTTPS", 1)[1]
    return re.search(r"```nginx\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]


def replaced(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"the page's block no longer has {old!r} once"
    return text.replace(old, new)


@pytest.fixture
def up(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """`moorage up` on loopback, as the page says to keep it: its URL and the local admin key."""
    data = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOORAGE_")}
    env.update(MOORAGE_DATA_DIR=str(data), MOORAGE_PORT="0", MOORAGE_SANDBOX_DRIVER="process",
               MOORAGE_LOG_LEVEL="warning")
    with moorage_up(data, env, tmp_path / "up.log") as (_, url):
        yield url, (data / "local-admin.key").read_text().strip()


def start_nginx(tmp: Path, block: str) -> tuple[subprocess.Popen[bytes], int]:
    """nginx with the block in its http context, as /etc/nginx/conf.d/ files are; on a port another test took first,
    again on another."""
    exe = shutil.which("nginx") or "/usr/sbin/nginx"
    assert os.path.exists(exe), "nginx is needed (scripts/bootstrap.sh --test installs it)"
    for _ in range(3):
        port = free_port()
        temp = "\n".join(f"    {kind}_temp_path {tmp}/{kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi",
                                                                          "scgi"))
        conf = tmp / "nginx.conf"
        conf.write_text(f"daemon off;\nworker_processes 1;\npid {tmp}/nginx.pid;\nerror_log {tmp}/error.log;\n"
                        + ("user root root;\n" if os.geteuid() == 0 else "")
                        + f"events {{ worker_connections 256; }}\nhttp {{\n    access_log off;\n{temp}\n"
                        + replaced(block, "listen 443 ssl;", f"listen 127.0.0.1:{port} ssl;") + "}\n")
        proc = subprocess.Popen([exe, "-p", str(tmp), "-c", str(conf), "-e", str(tmp / "error.log")],
                                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return proc, port
            except OSError:
                time.sleep(0.1)
        said = (tmp / "error.log").read_text(errors="replace")
        if proc.poll() is None:
            proc.kill()
        assert "Address already in use" in said, said[-3000:]
    raise AssertionError("nginx found no free port")


def test_the_pages_nginx_block_in_front_of_moorage_up(up: tuple[str, str], tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    url, key = up
    cert, private = certificate(tmp_path)
    block = replaced(nginx_block(), "/etc/ssl/moorage/fullchain.pem", str(cert))
    block = replaced(block, "/etc/ssl/moorage/privkey.pem", str(private))
    block = replaced(block, "proxy_pass http://127.0.0.1:7700;", f"proxy_pass {url};")
    (tmp_path / "nginx").mkdir()
    nginx, port = start_nginx(tmp_path / "nginx", block)
    base = f"https://127.0.0.1:{port}"
    agent = tmp_path / "web"
    agent.mkdir()
    (agent / "moorage.toml").write_text('[agent]\nname = "web"\nentry = "agent.py"\nports = [8080]\n'
                                        '[agent.lifecycle]\nusers = "auto"\n')
    (agent / "agent.py").write_text(AGENT)
    try:
        # A client on another machine: the proxy's address, the key, and the private CA (SSL_CERT_FILE).
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))
        with Client(base, key) as sdk:
            events = list(sdk.deploy_stream("web", agent))
            assert [e["event"] for e in events][-1] == "deployment" and any(e["event"] == "progress" for e in events)
            started, seen = time.monotonic(), []
            for event in sdk.stream("web", "hi", user="ada"):
                seen.append((event["event"], time.monotonic() - started, event["data"]))
            tokens = [t for kind, t, _ in seen if kind == "token"]
            (done,) = [(t, data) for kind, t, data in seen if kind == "done"]
            assert done[1]["reply"] == "done: hi" and len(tokens) == 2, seen
            assert done[0] - tokens[0] > 1.0, seen  # the first token came as it was said (2 s early), not with the reply

        auth = {"Authorization": f"Bearer {key}"}
        tls = ssl.create_default_context(cafile=str(cert))
        page = httpx.get(f"{base}/v1/agents/web/users/ada/app/", headers=auth, verify=tls, timeout=60)
        assert page.status_code == 200 and page.text == "hello from the app", page.text

        async def socket_echo() -> str:
            async with connect(f"wss://127.0.0.1:{port}/v1/agents/web/users/ada/app/ws", additional_headers=auth,
                               ssl=tls, open_timeout=60) as ws:
                await ws.send("through nginx")
                return str(await asyncio.wait_for(ws.recv(), 30))

        assert asyncio.run(socket_echo()) == "echo: through nginx"
        ui = httpx.get(f"{base}/ui/", verify=tls, timeout=60)
        assert ui.status_code == 200 and ui.headers["content-type"].startswith("text/html")

        # The CLI from another machine (its own empty data directory): the proxy's address and the key.
        env = {k: v for k, v in os.environ.items() if not k.startswith("MOORAGE_")}
        env.update(MOORAGE_API_URL=base, MOORAGE_API_KEY=key, MOORAGE_DATA_DIR=str(tmp_path / "elsewhere"))
        listed = subprocess.run([*MOORAGE, "agents", "--json"], env=env, cwd=ROOT, capture_output=True, text=True,
                                timeout=120)
        assert listed.returncode == 0 and [a["name"] for a in json.loads(listed.stdout)["data"]] == ["web"], listed
        # Without the CA it is told why, in one line.
        del env["SSL_CERT_FILE"]
        refused = subprocess.run([*MOORAGE, "agents"], env=env, cwd=ROOT, capture_output=True, text=True,
                                 timeout=120)
        assert refused.returncode == 2 and "CERTIFICATE_VERIFY_FAILED" in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    finally:
        nginx.send_signal(signal.SIGQUIT)
        try:
            nginx.wait(timeout=30)
        except subprocess.TimeoutExpired:
            nginx.kill()
