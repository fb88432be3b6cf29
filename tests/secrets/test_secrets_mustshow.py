"""Must show: a secret set through the API reaches the upstream (a loopback server this test starts, which the
test's operator policy allows) as a header on ``ctx.fetch``, and is nowhere else: not in any API response,
log line or span, not in the guest's environment, files or memory, not in the store's files in clear; a new
value is used from the next request on. An agent that opts into ``env`` gets the value in its environment.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
import pytest
import uvicorn

from moorage.api import create_app
from moorage.config import Config
from moorage.runtime.host import Host
from moorage.sandbox import process_limits as limits
from tests.api.conftest import free_port
from tests.egress.servers import start_upstream, stop
from tests.conftest import unspelled
from tests.runtime.conftest import write_agent
from tests.runtime.test_mustshow_no_credential import _scan_memory

AGENT = '''
import os

SEEN = []

async def on_message(ctx, message):
    if message == "env":
        return os.environ.get("GITHUB_TOKEN", "<absent>")
    r = await ctx.fetch(message, headers={"Authorization": "guest-tries-its-own"})
    SEEN.append(r["body"])  # the upstream's words stay in guest memory (the scan's positive control)
    with open("/work/fetched.txt", "a") as f:
        f.write(r["body"] + "\\n")
    return r["body"]
'''


class Live:
    def __init__(self, host: Host, url: str, cfg: Config, key: str) -> None:
        self.host, self.url, self.cfg, self.key = host, url, cfg, key
        self.responses: list[str] = []

    async def call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        async with httpx.AsyncClient(base_url=self.url, timeout=120,
                                     headers={"Authorization": f"Bearer {self.key}"}) as c:
            r = await c.request(method, path, **kw)
        self.responses.append(r.text + repr(dict(r.headers)))
        return r


@pytest.fixture
async def live(tmp_path: Path) -> AsyncIterator[Live]:
    cfg = Config(data_dir=tmp_path / "data", sandbox_driver="process", egress_allow_cidrs="127.0.0.0/8")
    host = Host.open(cfg)
    await host.start()
    app = create_app(host.runtime, cfg)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    _, key = host.store.operator.create_tenant("acme")
    try:
        yield Live(host, f"http://127.0.0.1:{port}", cfg, key.secret)
    finally:
        server.should_exit = True
        await task
        for sid in await host.driver.list():
            try:
                await (await host.driver.open(sid)).stop()
            except Exception:  # noqa: BLE001 - best-effort cleanup
                pass
        await host.close()


async def _deploy(live: Live, tmp_path: Path, name: str, manifest: str) -> None:
    agent = write_agent(tmp_path / name, name, AGENT, manifest)
    from moorage.cli.up import tar_dir

    r = await live.call("POST", f"/v1/agents/{name}/deployments", content=tar_dir(agent),
                        headers={"content-type": "application/gzip"})
    assert r.status_code == 201, r.text


@pytest.mark.timeout(300)
async def test_a_secret_set_by_api_reaches_the_upstream_and_nothing_else(live: Live, tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    up = start_upstream("api")
    try:
        secret = f"ghp_canary_{uuid.uuid4().hex}"
        rotated = f"ghp_rotated_{uuid.uuid4().hex}"
        await _deploy(live, tmp_path, "gh", f'''[agent.egress]
allow = ["http://127.0.0.1:{up.port}"]
[agent.secrets]
GITHUB_TOKEN = {{ header = "Authorization", format = "Bearer {{}}", hosts = ["127.0.0.1:{up.port}"] }}
''')
        r = await live.call("PUT", "/v1/agents/gh/secrets/GITHUB_TOKEN", json={"value": secret})
        assert r.status_code == 200 and r.json()["version"] == 1 and r.json()["name"] == "GITHUB_TOKEN"

        turn = await live.call("POST", "/v1/agents/gh/invoke", json={"message": f"{up.base}/user", "user": "ada"})
        assert turn.status_code == 200, turn.text
        assert turn.json()["reply"] == "api GET /user"
        assert up.hits[-1].headers["authorization"] == f"Bearer {secret}"  # the host's, not the guest's own

        # Rotation: the next request carries the new value, nothing rebuilt or redeployed.
        assert (await live.call("PUT", "/v1/agents/gh/secrets/GITHUB_TOKEN", json={"value": rotated})).json()["version"] == 2
        turn2 = await live.call("POST", "/v1/agents/gh/invoke", json={"message": f"{up.base}/again", "user": "ada"})
        assert up.hits[-1].path == "/again" and up.hits[-1].headers["authorization"] == f"Bearer {rotated}"

        listed = (await live.call("GET", "/v1/agents/gh/secrets")).json()["data"]
        assert [(s["name"], s["version"]) for s in listed] == [("GITHUB_TOKEN", 2)]
        for trace_id in (turn.json()["trace_id"], turn2.json()["trace_id"]):
            t = await live.call("GET", f"/v1/traces/{trace_id}")
            assert t.status_code == 200 and "egress" in t.text  # the attempt is traced...
        ts = live.host.store.tenant(live.host.store.authenticate(live.key))
        egress_spans = [s for s in ts.spans.recent(limit=1000) if s.name == "egress"]
        assert len(egress_spans) == 2 and all(s.attrs["egress.secrets"] == 1 for s in egress_spans)

        needles = [secret, rotated]
        # ...and no API response, span or log line holds a value.
        for text in live.responses + [repr(ts.spans.recent(limit=1000)), caplog.text]:
            assert not any(n in text for n in needles)
        # The store's files hold ciphertext only. (The turns' automatic checkpoints are written after their
        # replies: wait for the turns to end, and walk with os.walk, which skips what a background prune removes
        # under it, where rglob raises.)
        for _ in range(600):
            if not live.host.runtime.turns:
                break
            await asyncio.sleep(0.05)
        for dirpath, _, names in os.walk(live.cfg.data_dir):
            for name in names:
                p = Path(dirpath) / name
                if p.is_symlink() or not p.is_file():  # (sockets, FIFOs)
                    continue
                try:
                    data = p.read_bytes()
                except FileNotFoundError:
                    continue
                assert not any(n.encode() in data for n in needles), p

        # The guest: environment, files (from inside and from the host), every process's memory.
        (rec,) = ts.sandboxes.list(agent_id="gh")
        sb = await live.host.driver.open(rec.id)
        env = await sb.exec(["env"])
        assert env.exit_code == 0 and not any(n.encode() in env.stdout for n in needles)
        for root in ("/work", "/tmp", "/run", "/etc", "/home", "/root", "/opt"):
            for n in needles:
                g = await sb.exec(["grep", "-r", "-l", "-s", "-e", unspelled(n), root], timeout=60)
                assert g.stdout == b"", (root, g.stdout[:300])
        assert (await sb.exec(["grep", "-r", "-l", "-e", unspelled("api GET /user"), "/work"])).stdout.strip() == \
            b"/work/fetched.txt"  # the search (same kind of pattern) sees what is there
        pid = sb.meta.get("pid")  # type: ignore[attr-defined]
        control_seen = False
        for p in [pid, *limits.descendants(pid)]:
            found, _ = _scan_memory(p, [n.encode() for n in needles] + [b"api GET /again"])
            assert not any(found[n.encode()] for n in needles), p
            control_seen = control_seen or found[b"api GET /again"]
        assert control_seen  # the scan does see what the guest holds

        # Removing it stops it at once.
        assert (await live.call("DELETE", "/v1/agents/gh/secrets/GITHUB_TOKEN")).json() == {"removed": "GITHUB_TOKEN"}
        await live.call("POST", "/v1/agents/gh/invoke", json={"message": f"{up.base}/after", "user": "ada"})
        assert up.hits[-1].headers["authorization"] == "guest-tries-its-own"
    finally:
        stop(up)


@pytest.mark.timeout(300)
async def test_env_opt_in_puts_the_value_in_the_guest_environment(live: Live, tmp_path: Path) -> None:
    await _deploy(live, tmp_path, "envy", '[agent.secrets]\nenv = ["GITHUB_TOKEN"]\n')
    assert (await live.call("PUT", "/v1/agents/envy/secrets/GITHUB_TOKEN", json={"value": "from-env"})).status_code == 200
    assert (await live.call("PUT", "/v1/agents/envy/users/bob/secrets/GITHUB_TOKEN",
                            json={"value": "bobs-own"})).status_code == 200
    r = await live.call("POST", "/v1/agents/envy/invoke", json={"message": "env", "user": "ada"})
    assert r.json()["reply"] == "from-env"
    r = await live.call("POST", "/v1/agents/envy/invoke", json={"message": "env", "user": "bob"})
    assert r.json()["reply"] == "bobs-own"
