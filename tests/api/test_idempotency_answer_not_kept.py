"""A request with an Idempotency-Key that was carried out, but whose answer found no room on the disk to be kept:
its caller gets a 507 saying it was carried out, a retry with the key waits (409) while there is no room, and once
there is, the retry replays the answer: the work is not done twice. The disk is made full at exactly the answer's
write (SQLite's own "database or disk is full" error from the journal's write); tests/diskfull/
test_idempotency_disk_full.py fills a real small disk at every amount of room, where whether this window is met
depends on the store's file layout (SQLite's log reuses space it already has), so it is pinned here."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from moorage.store import Store
from moorage.store.repos.journal import Journal
from tests.api.conftest import acme, aclient, agent_archive, live_rt, runtime  # noqa: F401 - fixtures


async def test_a_request_done_whose_answer_had_no_room_is_replayed_once_there_is(
        live_rt, store: Store, acme: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    real = Journal.complete
    full = {"on": False, "refused": 0}

    def complete(self, key, **kw):  # type: ignore[no-untyped-def]
        if full["on"] and key.startswith("http:"):
            full["refused"] += 1
            raise sqlite3.OperationalError("database or disk is full")
        return real(self, key, **kw)

    monkeypatch.setattr(Journal, "complete", complete)
    ts = store.tenant(store.authenticate(acme))
    async with aclient(live_rt, acme) as c:
        r = await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path),
                         headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        assert (await c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"})).status_code == 200
        key, fact = {"Idempotency-Key": "fact-once"}, {"subject": "ada", "attribute": "tea", "value": "green"}
        full["on"] = True
        first = await c.post("/v1/agents/echo/users/ada/facts", headers=key, json=fact)
        assert first.status_code == 507, first.text
        assert "carried out, but its answer could not be kept" in first.json()["detail"], first.text
        assert "same Idempotency-Key" in first.json()["hint"]
        waiting = await c.post("/v1/agents/echo/users/ada/facts", headers=key, json=fact)
        assert waiting.status_code == 409, waiting.text  # no room yet: the answer is not there to replay
        full["on"] = False  # room again: the answer is kept by the host's retry within a second or two
        for _ in range(50):
            again = await c.post("/v1/agents/echo/users/ada/facts", headers=key, json=fact)
            if again.status_code != 409:
                break
            await asyncio.sleep(0.2)
        assert again.status_code == 201 and again.headers.get("Idempotent-Replayed") == "true", again.text
        assert full["refused"] >= 1
    rows = ts.read("SELECT COUNT(*) FROM facts WHERE attribute = 'tea'")
    assert rows[0][0] == 1  # done once, not twice
