"""A webhook that could never be delivered is refused when it is made (422 saying why), not accepted with a 201 and
then never sent: a secret that cannot sign (empty, not base64, too short), a URL with no host or a malformed address
or port. One made before these checks (in the store as it is) fails its own attempts, recorded, while the
deliveries of the same round still go out."""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import pytest

from moorage.store import Store
from moorage.webhooks import Dispatcher
from tests.api.conftest import aclient, agent_archive

GZ = {"content-type": "application/gzip"}
GOOD = "whsec_" + base64.b64encode(b"k" * 32).decode()


@pytest.mark.parametrize("body, why", [
    ({"secret": "whsec_!!!"}, "0 usable bytes"),
    ({"secret": "whsec_"}, "0 usable bytes"),
    ({"secret": "whsec_" + "é" * 40}, "0 usable bytes"),
    ({"secret": "whsec_YWJj"}, "3 usable bytes"),
    ({"secret": "whsec_" + base64.b64encode(b"k" * 65).decode()}, "65 usable bytes"),
    ({"url": "http://"}, "names no host"),
    ({"url": "http://[::1/hooks"}, "malformed"),
    ({"url": "https://example.com:99999/hooks"}, "malformed"),
])
async def test_a_webhook_that_could_never_be_delivered_is_refused(live_rt, acme: str, tmp_path: Path, body, why):
    async with aclient(live_rt, acme) as c:
        assert (await c.post("/v1/agents/echo/deployments", content=agent_archive(tmp_path), headers=GZ)).status_code == 201
        r = await c.post("/v1/agents/echo/webhooks", json={"url": "https://example.com/hooks", **body})
        assert r.status_code == 422 and why in r.json()["detail"], r.text
        assert (await c.get("/v1/agents/echo/webhooks")).json()["data"] == []
        ok = await c.post("/v1/agents/echo/webhooks", json={"url": "https://example.com:8443/hooks", "secret": GOOD})
        assert ok.status_code == 201 and ok.json()["secret"] == GOOD


async def test_a_secret_that_cannot_sign_fails_its_own_attempts_only(store: Store, acme: str):
    ts = store.tenant(store.authenticate(acme))
    broken = ts.webhooks.create("bot", "https://broken.example/hooks", None, "whsec_!!!")  # as older versions kept it
    fine = ts.webhooks.create("bot", "https://fine.example/hooks", None, GOOD)
    ts.deliveries.enqueue("bot", "execution.succeeded", {"execution_id": "ex1"})
    seen: list[str] = []

    def receive(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.host)
        return httpx.Response(204)

    dispatcher = Dispatcher(store, transport=httpx.MockTransport(receive))
    try:
        assert await dispatcher.tick() == 2
    finally:
        await dispatcher.aclose()
    assert seen == ["fine.example"]
    (ok,) = ts.deliveries.list(fine.id)
    assert ok.status == "delivered"
    (bad,) = ts.deliveries.list(broken.id)
    assert bad.status == "pending" and bad.attempts == 1 and bad.next_at > ok.updated_at  # retried later
    (attempt,) = ts.deliveries.attempts(bad.id)
    assert "secret cannot sign" in attempt.error
