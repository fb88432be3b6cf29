"""A fork into an end-user the product registered before (PUT /v1/agents/{a}/users/{u} with metadata and limits)
who has no instance yet keeps that registration's metadata and limits: they are the product's. Before, the fork
wrote the source user's over them (``{}`` for a source registered without any), so the new user lost its plan and
its caps. A user the fork makes anew still gets the source's."""

from __future__ import annotations

from pathlib import Path

from tests.api.conftest import acme, aclient, live_rt, runtime  # noqa: F401 - fixtures
from tests.timetravel.conftest import tt_archive

USERS = "/v1/agents/tt/users"
ADA = {"metadata": {"plan": "free", "name": "Ada"}, "limits": {"tokens_per_month": 1000}}
BEA = {"metadata": {"plan": "pro", "crm_id": 42}, "limits": {"tokens_per_month": 50_000,
                                                              "compute_seconds_per_day": 600}}


async def test_a_fork_into_a_registered_user_keeps_their_metadata_and_limits(live_rt, acme: str,  # noqa: F811
                                                                             tmp_path: Path) -> None:
    async with aclient(live_rt, acme) as c:
        r = await c.post("/v1/agents/tt/deployments", content=tt_archive(tmp_path),
                         headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        assert (await c.put(f"{USERS}/ada", json=ADA)).status_code == 201
        assert (await c.post("/v1/agents/tt/invoke", json={"message": "turn 1", "user": "ada"})).status_code == 200
        one = (await c.get(f"{USERS}/ada/checkpoints")).json()["data"][-1]["id"]
        for u in ("bea", "cy"):  # registered, no instance yet
            r = await c.put(f"{USERS}/{u}", json=BEA if u == "bea" else {})
            assert r.status_code == 201, r.text

        r = await c.post(f"{USERS}/ada/checkpoints/{one}/fork", json={"to_users": ["bea", "dee"]})
        assert r.status_code == 201, r.text
        bea = (await c.get(f"{USERS}/bea")).json()
        assert (bea["metadata"], bea["limits"]) == (BEA["metadata"], BEA["limits"]), bea
        dee = (await c.get(f"{USERS}/dee")).json()  # made by the fork: the source's
        assert (dee["metadata"], dee["limits"]) == (ADA["metadata"], ADA["limits"]), dee
        r = await c.post("/v1/agents/tt/invoke", json={"message": "ls", "user": "bea"})
        assert r.status_code == 200 and "note 1 for ada" in r.json()["reply"], r.text

        # The same through the sandbox verb (a fork of the instance as it is now), for a user registered with
        # nothing: nothing of the source's is written over their registration either.
        sid = (await c.get("/v1/sandboxes", params={"agent": "tt"})).json()["data"]
        sid = next(b["id"] for b in sid if b["scope"].endswith("/ada"))
        r = await c.post(f"/v1/sandboxes/{sid}/fork", json={"to_users": ["cy"]})
        assert r.status_code == 200, r.text
        cy = (await c.get(f"{USERS}/cy")).json()
        assert (cy["metadata"], cy["limits"]) == ({}, {}), cy
