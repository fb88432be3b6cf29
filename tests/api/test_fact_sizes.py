"""A fact whose value is a few KiB (a note, a pasted address block) is stored on both backends: on PostgreSQL it was
a 500, its comparable form being more than an index entry may hold. Recorded again it is the same fact; a subject
or attribute too long to be a name is a 422 on both."""

from __future__ import annotations

import os
from pathlib import Path

from moorage.store import Store
from tests.api.conftest import acme, aclient, agent_archive, live_rt, runtime  # noqa: F401 - fixtures

FACTS = "/v1/agents/echo/users/ada/facts"


async def test_a_fact_of_a_few_kib_is_stored_once_and_a_long_name_is_refused(
        live_rt, store: Store, acme: str, tmp_path: Path) -> None:  # noqa: F811
    long = "note " + os.urandom(3000).hex()  # 6 KiB, well past PostgreSQL's 2,704-byte index entry
    async with aclient(live_rt, acme) as c:
        r = await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path),
                         headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        assert (await c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"})).status_code == 200
        for _ in range(2):
            r = await c.post(FACTS, json={"subject": "ada", "attribute": "notes", "value": long})
            assert r.status_code == 201, r.text
        current = [f for f in (await c.get(FACTS)).json()["data"] if f["attribute"] == "notes"]
        assert [f["value"] for f in current] == [long], current  # recorded again: the same fact, not a second
        r = await c.post(FACTS, json={"subject": "ada", "attribute": "notes", "value": long + " (edited)"})
        assert r.status_code == 201, r.text
        current = [f for f in (await c.get(FACTS)).json()["data"] if f["attribute"] == "notes"
                   and f.get("valid_to") is None and f.get("status", "active") == "active"]
        assert [f["value"] for f in current] == [long + " (edited)"], current  # a new value supersedes it
        r = await c.post(FACTS, json={"subject": "ada", "attribute": "x" * 600, "value": "v"})
        assert r.status_code == 422 and "longer than 500 bytes" in r.json()["detail"], r.text
