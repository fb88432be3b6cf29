"""A long-running host must not keep the output of every detached exec it ever ran. Found by the soak run
(bench/soak): finished execs were held in memory with up to 1 MiB of output per stream, 200 of them whatever their
size (400 MiB), and a forgotten user's stayed there too."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from moorage.runtime import exec_jobs
from moorage.store import Store
from tests.api.conftest import acme, aclient, agent_archive, live_rt, runtime  # noqa: F401 - fixtures

GZ = {"content-type": "application/gzip"}
MIB = 1 << 20


def held_bytes(runtime) -> int:  # noqa: ANN001 - the fixture's Runtime
    return sum(len(s.buf) for j in exec_jobs.ExecJobs.of(runtime).jobs.values() for s in j.streams.values())


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_finished_execs_output_is_held_within_a_budget_and_not_after_forget(
        live_rt, runtime, store: Store, acme: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    monkeypatch.setattr(exec_jobs, "KEEP_FINISHED_BYTES", 2 * MIB, raising=False)
    async with aclient(live_rt, acme) as c:
        assert (await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path), headers=GZ)).status_code == 201
        assert (await c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ann"})).status_code == 200
        sid = (await c.get("/v1/agents/echo/users/ann")).json()["instance"]["sandbox_id"]
        ids = []
        for _ in range(4):  # 1 MiB of output each
            r = await c.post(f"/v1/sandboxes/{sid}/exec", json={
                "argv": ["sh", "-c", f"head -c {MIB} /dev/zero | tr '\\0' a"], "detach": True})
            assert r.status_code == 202, r.text
            ids.append(r.json()["id"])
            while (view := (await c.get(f"/v1/executions/{ids[-1]}")).json())["status"] == "running":
                await asyncio.sleep(0.05)
            assert view["status"] == "succeeded" and view["stdout_bytes"] == MIB
        assert held_bytes(runtime) <= 2 * MIB, f"{held_bytes(runtime) / MIB:.1f} MiB of finished execs' output held"
        # The oldest is shown from its record now: how it ended and the tail of its output.
        first = (await c.get(f"/v1/executions/{ids[0]}")).json()
        assert first["status"] == "succeeded" and first["stdout_bytes"] == MIB and first["stdout"].endswith("aaa")

        assert (await c.delete("/v1/agents/echo/users/ann")).status_code == 200
    assert held_bytes(runtime) == 0 and not exec_jobs.ExecJobs.of(runtime).jobs
