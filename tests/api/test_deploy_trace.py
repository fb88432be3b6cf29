"""A deploy is a trace of the tenant's: the request's span, and under it a ``deploy`` span (ok, or error with the
reason), readable by the tenant and nobody else. The spans of the packages a build installs through the egress
gateway, under the deploy span, are checked in ``tests/egress/test_vm_network.py``."""

from __future__ import annotations

from pathlib import Path

from tests.api.conftest import aclient, agent_archive

GZ = {"content-type": "application/gzip"}


async def test_a_deploy_records_its_span_under_the_request(live_rt, acme: str, globex: str, tmp_path: Path) -> None:
    async with aclient(live_rt, acme) as c:
        r = await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path), headers=GZ)
        assert r.status_code == 201, r.text
        trace_id, dep = r.headers["x-trace-id"], r.json()
        spans = (await c.get(f"/v1/traces/{trace_id}")).json()["spans"]
        [request] = [s for s in spans if s["parent_id"] is None]
        [deploy] = [s for s in spans if s["name"] == "deploy"]
        assert request["name"] == "POST /v1/agents/{agent}/deployments"
        assert deploy["parent_id"] == request["span_id"] and deploy["status"] == "ok"
        assert deploy["attrs"]["deployment"] == dep["id"] and deploy["attrs"]["deployment.number"] == 1

        # A deploy whose code does not load fails with its reason, in the trace too.
        broken = agent_archive(tmp_path, "echo", "raise RuntimeError('bad import')\n", version="b")
        r = await c.post("/v1/agents/echo/deployments", content=broken, headers=GZ)
        assert r.status_code >= 400
        spans = (await c.get(f"/v1/traces/{r.headers['x-trace-id']}")).json()["spans"]
        [failed] = [s for s in spans if s["name"] == "deploy"]
        assert failed["status"] == "error" and failed["attrs"]["error.message"]
    # Another tenant does not see it.
    async with aclient(live_rt, globex) as c:
        assert (await c.get(f"/v1/traces/{trace_id}")).status_code == 404
