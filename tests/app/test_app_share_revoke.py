"""An agent app's answer opened with a share link ends when the link is revoked while it streams, as the owner's
route ends with its key and the link's WebSocket with the link: an event stream with a final ``credential-ended``
error event, a slow download cut before its end. Before, both ran on under the revoked link (for as long as the app
kept sending, up to ``app_max_duration_s``)."""

from __future__ import annotations

import asyncio
import json
import io
import tarfile
from pathlib import Path

import httpx
import pytest

from moorage.api import credential_watch
from tests.api.conftest import acme, aclient, live_rt, runtime  # noqa: F401  (fixtures)
from tests.app.wsapp import agent_py

AGENT = agent_py(r'''
import time


class Handler(AppHandler):
    def respond(self):
        sse = self.target.startswith("/events")
        ctype = b"text/event-stream" if sse else b"application/octet-stream"
        self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: " + ctype + b"\r\nTransfer-Encoding: chunked\r\n\r\n")
        for n in range(150):  # 30 s of it, a piece every 200 ms
            piece = b"data: tick %d\n\n" % n if sse else b"x" * 1024
            try:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                self.wfile.flush()
            except OSError:
                return
            time.sleep(0.2)
        self.wfile.write(b"0\r\n\r\n")


serve(Handler)


async def on_message(ctx, message):
    return "ok"
''')


@pytest.fixture(autouse=True)
def quick_recheck(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(credential_watch, "RECHECK_S", 0.2)


def _archive(tmp: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in (("moorage.toml", '[agent]\nname = "web"\nentry = "agent.py"\nports = [8080]\n'
                                            '[agent.lifecycle]\nusers = "auto"\n'), ("agent.py", AGENT)):
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


async def test_a_revoked_share_link_ends_the_apps_stream_and_download(live_rt, acme: str,  # noqa: F811
                                                                      tmp_path: Path) -> None:
    async with aclient(live_rt, acme) as c:
        r = await c.post("/v1/agents/web/deployments", content=_archive(tmp_path),
                         headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        assert (await c.post("/v1/agents/web/invoke", json={"message": "hi", "user": "ada"})).status_code == 200
        links = "/v1/agents/web/users/ada/share-links"

        async with httpx.AsyncClient(base_url=live_rt.url, timeout=60) as anyone:
            # An event stream: the link revoked after the first ticks ends it with the final error event.
            link = (await c.post(links, json={})).json()
            lines: list[str] = []
            async with anyone.stream("GET", f"{link['url']}events") as stream:
                assert stream.status_code == 200
                loop = asyncio.get_running_loop()
                started = loop.time()
                async for line in stream.aiter_lines():
                    lines.append(line)
                    if line == "data: tick 2":
                        assert (await c.delete(f"{links}/{link['id']}")).status_code == 200
                        revoked = loop.time()
                took = loop.time() - started
            assert "event: error" in lines and any("credential-ended" in x for x in lines), lines[-5:]
            ended = json.loads(next(x for x in lines if "credential-ended" in x).removeprefix("data: "))
            assert "cancelled" not in ended["hint"], ended  # an app's request starts no turn: none was cancelled
            assert took < 15 and loop.time() - revoked < 5, (took, lines[-5:])  # not the app's 30 s

            # A download: cut before its end (a body of another kind cannot say why).
            link = (await c.post(links, json={})).json()
            got = 0
            with pytest.raises(httpx.HTTPError):
                async with anyone.stream("GET", f"{link['url']}download") as stream:
                    assert stream.status_code == 200
                    started = loop.time()
                    async for chunk in stream.aiter_bytes():
                        got += len(chunk)
                        if got >= 3 * 1024 and got - len(chunk) < 3 * 1024:
                            assert (await c.delete(f"{links}/{link['id']}")).status_code == 200
            assert got < 100 * 1024 and loop.time() - started < 15, got

            # The revoked link opens nothing more.
            assert (await anyone.get(f"{link['url']}events")).status_code == 404
