"""``DELETE /v1/agents/{agent}/deployments/{number}`` over a real runtime (process sandboxes), both store backends:
the live and a building deployment are refused, a deleted one is not listed nor a rollback's target and its
package stops counting, the host deletes its package file at its next collection, and no other tenant, key of
another agent or read-only key can delete one."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from moorage.errors import NotFound
from tests.api.conftest import aclient, agent_archive

pytestmark = pytest.mark.asyncio
GZ = {"content-type": "application/gzip"}


async def _deploy(c: Any, archive: bytes) -> dict[str, Any]:
    r = await c.post("/v1/agents/echo/deployments", content=archive, headers=GZ)
    assert r.status_code == 201, r.text
    return r.json()


async def test_delete_a_deployment_and_its_package_goes(live_rt, runtime, store, acme: str, globex: str,
                                                       tmp_path: Path) -> None:
    async with aclient(live_rt, acme) as c:
        archives = {n: agent_archive(tmp_path, version=f"-{n}") for n in (1, 2, 3)}
        d1, d2, d3 = [await _deploy(c, archives[n]) for n in (1, 2, 3)]
        pkg = {d["number"]: runtime.packages / f"{d['package_sha256']}.tar.gz" for d in (d1, d2, d3)}
        ts = store.tenant(store.authenticate(acme))
        counted = ts.deployments.package_bytes()
        assert counted == sum(p.stat().st_size for p in pkg.values())

        # Not the live one (3), nor a number it has not, nor something that is not a number.
        r = await c.delete("/v1/agents/echo/deployments/3")
        assert r.status_code == 409 and "live" in r.json()["detail"], r.text
        assert (await c.delete("/v1/agents/echo/deployments/9")).status_code == 404
        for bad in ("0", "x", "1.5", "-1", "99999999999999999999"):
            r = await c.delete(f"/v1/agents/echo/deployments/{bad}")
            assert r.status_code == 422 and r.headers["content-type"].startswith("application/problem+json"), (bad, r.text)
        assert (await c.delete("/v1/agents/nobody/deployments/1")).status_code == 404

        # Another tenant's admin key, a key of another agent, a read-only key: none deletes it.
        async with aclient(live_rt, globex) as g:
            assert (await g.delete("/v1/agents/echo/deployments/1")).status_code == 404
        other_agent = ts.keys.create(["deploy", "read"], agent="other").secret
        read_only = ts.keys.create(["read"]).secret
        for secret, status in ((other_agent, 403), (read_only, 403)):
            async with aclient(live_rt, secret) as k:
                r = await k.delete("/v1/agents/echo/deployments/1")
                assert r.status_code == status, (status, r.text)
        assert [d["number"] for d in (await c.get("/v1/agents/echo/deployments")).json()["data"]] == [1, 2, 3]

        r = await c.delete("/v1/agents/echo/deployments/1")
        assert r.status_code == 200 and r.json()["status"] == "deleted" and r.json()["number"] == 1, r.text
        assert (await c.delete("/v1/agents/echo/deployments/1")).json()["status"] == "deleted"  # again: the same
        assert [d["number"] for d in (await c.get("/v1/agents/echo/deployments")).json()["data"]] == [2, 3]
        assert ts.deployments.package_bytes() == counted - pkg[1].stat().st_size
        r = await c.post("/v1/agents/echo/rollback", json={"number": 1})
        assert r.status_code == 404 and "was deleted" in r.json()["detail"], r.text
        r = await c.post("/v1/agents/echo/rollback", json={})  # back one: to 2, the one before the live one
        assert r.status_code == 200 and r.json()["number"] == 2, r.text
        assert (await c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"})).json()["reply"] == "echo-2: hi"

        # The host's collection deletes the package file no deployment names (written long enough ago), and only it.
        from moorage.fleet.gc import template_use

        for p in pkg.values():
            os.utime(p, (p.stat().st_mtime - 3600,) * 2)
        await runtime.templates.collect(template_use(store, grace_s=600), grace_s=600)
        assert [n for n, p in pkg.items() if p.exists()] == [2, 3]
        # The same package deployed again is built anew from the upload, a new number, and counts again.
        d4 = await _deploy(c, archives[1])
        assert d4["number"] == 4 and d4["package_sha256"] == d1["package_sha256"] and pkg[1].exists()
        assert ts.deployments.package_bytes() == counted
        assert (await c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"})).json()["reply"] == "echo-1: hi"


async def test_a_rollback_that_read_the_agent_before_a_delete_does_not_make_it_live(runtime, store, acme: str,
                                                                                   tmp_path: Path) -> None:
    """A rollback reads the agent, builds the template, then sets it live by compare-and-set: a delete in between
    raises the agent's version, so the rollback reads the deployment again and refuses."""
    principal = store.authenticate(acme)
    for n in (1, 2):
        await runtime.deploy(principal, agent_archive(tmp_path, version=f"-{n}"))
    ts = store.tenant(principal)
    stale = ts.agents.get("echo")
    first = ts.deployments.list(stale.id)[0]
    ts.deployments.delete(first.id)
    with pytest.raises(NotFound, match="was deleted"):
        runtime._set_live(ts, stale, first)
    assert ts.agents.get("echo").live_deployment == stale.live_deployment
