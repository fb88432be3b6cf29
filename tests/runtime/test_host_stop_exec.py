"""A clean stop of the host ``moorage up`` runs (``Host.open``) while a detached exec runs: the command is ended
(killed in its sandbox) and recorded as cancelled with why and its output so far, the instance it held sleeps, and
the stop does not wait out the shutdown's 30 s for busy instances."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from moorage.config import Config
from moorage.runtime.exec_jobs import ExecJobs
from moorage.runtime.host import SHUTDOWN_TURN_WAIT_S, Host
from moorage.store import Scope
from tests.api.conftest import agent_archive
from tests.runtime.test_host_adaptive import serve

# Prints its pid, then runs far longer than the test.
LONG = ["sh", "-c", "echo ready $$; exec sleep 600"]


@pytest.mark.timeout(240)
async def test_a_clean_stop_ends_a_running_detached_exec_and_sleeps_its_instance(tmp_path: Path) -> None:
    cfg = Config(data_dir=tmp_path / "data", sandbox_driver="process")
    host = Host.open(cfg)
    await host.start()
    server, task, url = await serve(host, cfg)
    try:
        _, key = host.store.operator.create_tenant("acme")
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key.secret}"}, timeout=120) as c:
            r = await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path),
                             headers={"content-type": "application/gzip"})
            assert r.status_code == 201, r.text
            assert (await c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "u1"})).status_code == 200
            ts = host.store.tenant(host.store.authenticate(key.secret))
            sid = ts.sandboxes.for_scope(Scope.for_user("echo", "u1")).id
            r = await c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": LONG, "detach": True, "timeout_s": 900})
            assert r.status_code == 202, r.text
            ex_id = r.json()["id"]
            for _ in range(200):
                view = (await c.get(f"/v1/executions/{ex_id}")).json()
                if "ready" in view["stdout"]:
                    break
                await asyncio.sleep(0.05)
            assert view["status"] == "running" and "ready" in view["stdout"], view
    finally:
        server.should_exit = True
        await task
        started = time.monotonic()
        await host.close()
        took = time.monotonic() - started
    assert took < SHUTDOWN_TURN_WAIT_S / 2, f"the stop waited {took:.1f} s for the exec's instance"

    host2 = Host.open(cfg)  # another process on this host: what the record says
    await host2.start()
    try:
        ts2 = host2.store.tenant(host2.store.authenticate(key.secret))
        rec = ts2.sandboxes.for_scope(Scope.for_user("echo", "u1"))
        assert rec is not None and rec.state == "sleeping"
        after = ExecJobs(host2.runtime).view(ts2, ts2.executions.get(ex_id))
        assert after["status"] == "cancelled" and "host stopped" in after["error"], after
        assert "ready" in after["stdout"]  # its output up to the stop was recorded
    finally:
        await host2.close()
