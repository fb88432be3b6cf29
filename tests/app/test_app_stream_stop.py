"""SIGTERM to ``moorage up`` (``systemctl stop``, Ctrl-C) while a caller holds an agent app's endless answer open (a
server-sent events page, a long poll): the server's graceful stop waited for that answer, which may last
``app_max_duration_s`` (600 s), so systemd's TimeoutStopSec killed the host with its instances awake. The app's
answers end as the signal arrives (as detached execs do), an app WebSocket is closed with 1012, and the host stops
at once with every instance asleep."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from moorage import Client
from moorage.devservices.fleet import LocalHost
from tests.app.wsapp import agent_py

#: What the stop may take here: far under app_max_duration_s (and the shutdown's 30 s wait for busy instances).
STOP_S = 20.0

AGENT = agent_py(r'''
import time


class Handler(AppHandler):
    def respond(self):
        if self.upgrade():
            self.switch()
            while True:  # echoes until the caller goes
                opcode, data = self.read_frame()
                if opcode is None or opcode == 8:
                    return
                self.frame(1, data)
        self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        n = 0
        while True:  # an event every 200 ms, for ever
            n += 1
            event = b"data: tick %d\n\n" % n
            self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
            self.wfile.flush()
            time.sleep(0.2)


serve(Handler)


async def on_message(ctx, message):
    return "ok"
''')


def _agent(tmp: Path) -> Path:
    d = tmp / "web"
    d.mkdir()
    (d / "moorage.toml").write_text('[agent]\nname = "web"\nentry = "agent.py"\nports = [8080]\n'
                                    '[agent.lifecycle]\nusers = "auto"\nsleep = "fixed:3600"\n')
    (d / "agent.py").write_text(AGENT)
    return d


def test_sigterm_ends_an_app_stream_and_its_websocket_and_stops_at_once(tmp_path: Path) -> None:
    host = LocalHost("up", tmp_path / "data", {"MOORAGE_LOG_LEVEL": "info"}, start_timeout_s=120)
    ticks: list[str] = []
    ended: list[BaseException | None] = []
    try:
        with Client(host.url, host.key) as sdk:
            sdk.deploy("web", _agent(tmp_path))
            sdk.invoke("web", "hi", user="ada")
        app = f"{host.url}/v1/agents/web/users/ada/app"
        auth = {"Authorization": f"Bearer {host.key}"}

        def follow() -> None:
            try:
                with httpx.stream("GET", f"{app}/events", headers=auth, timeout=120) as r:
                    assert r.status_code == 200, r.read()
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            ticks.append(line)
                ended.append(None)
            except BaseException as e:  # noqa: BLE001 - what ended it is asserted below
                ended.append(e)

        follower = threading.Thread(target=follow, daemon=True)
        follower.start()
        with connect(app.replace("http://", "ws://") + "/socket", additional_headers=auth, open_timeout=30) as ws:
            ws.send("ping")
            assert ws.recv(timeout=30) == "ping"
            deadline = time.time() + 30
            while len(ticks) < 2:
                assert time.time() < deadline and follower.is_alive(), (ticks, ended)
                time.sleep(0.1)

            code, took = host.sigterm(STOP_S)
            assert code == 0, (code, took, host.log.read_text(errors="replace")[-3000:])
            follower.join(timeout=10)
            assert ended == [None], ended  # the answer ended (what came was sent), the host did not cut it
            said = host.log.read_text(errors="replace")
            assert "host stopping, awake instances put to sleep slept=1 still_awake=0" in said, said[-3000:]
            with pytest.raises(ConnectionClosed) as closed:  # closed by the stopping server: 1012, "service restart"
                ws.recv(timeout=5)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1012, closed.value
    finally:
        if host.proc.poll() is None:
            host.kill()
