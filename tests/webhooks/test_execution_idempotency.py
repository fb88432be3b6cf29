"""An Idempotency-Key names one async turn as it names one synchronous turn: the same key with the same message is
the same execution; with another message it is a 422, never the first execution answered while the new message is
silently dropped (also when the key was first used by a synchronous turn)."""

from __future__ import annotations

from pathlib import Path

from moorage.store import Store
from tests.api.conftest import aclient, agent_archive

GZ = {"content-type": "application/gzip"}


async def test_a_key_reused_with_another_message_is_refused(live_rt, store: Store, acme: str, tmp_path: Path):
    async with aclient(live_rt, acme) as c:
        assert (await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path), headers=GZ)).status_code == 201

        async def submit(message: str, key: str) -> tuple[int, dict]:
            r = await c.post("/v1/agents/echo/invoke?async=true", json={"message": message, "user": "ann"},
                             headers={"Idempotency-Key": key})
            return r.status_code, r.json()

        status, first = await submit("book the 9:15", "req-1")
        assert status == 202
        status, again = await submit("book the 9:15", "req-1")
        assert status == 202 and again["id"] == first["id"]
        status, other = await submit("cancel everything", "req-1")
        assert status == 422 and "different request" in other["detail"], other

        sync = await c.post("/v1/agents/echo/invoke", json={"message": "hello", "user": "ann"},
                            headers={"Idempotency-Key": "req-2"})
        assert sync.status_code == 200
        status, other = await submit("goodbye", "req-2")
        assert status == 422 and "different request" in other["detail"], other
    ts = store.tenant(store.authenticate(acme))
    # Nothing was recorded for the refused ones (no delivery loop runs here: every execution is still unsettled).
    assert {e.input["message"] for e in ts.executions.unsettled()} == {"book the 9:15"}
