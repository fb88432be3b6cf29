"""``verify_webhook`` names the delivery (its signed ``webhook-id``) so a receiver drops a retried one: a real
server's delivery refused once and sent again carries the same id, and a receiver keyed on ``event.id`` acts once."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from moorage import AsyncClient
from moorage.client import WebhookEvent, WebhookSignatureError, new_webhook_secret, verify_webhook
from moorage.store import Store
from moorage.webhooks import Dispatcher, RetrySchedule
from moorage.webhooks.signing import sign
from tests.api.conftest import agent_archive
from tests.api.test_async_webhooks import Receiver, until


async def test_a_retried_delivery_has_the_same_id_and_is_handled_once(live_rt, store: Store, acme: str,
                                                                       tmp_path: Path) -> None:
    secret = new_webhook_secret()
    receiver = Receiver(down_for=1)  # the first attempt is answered 503: the dispatcher sends it again
    dispatcher = asyncio.create_task(Dispatcher(store, schedule=RetrySchedule((0.2,) * 4), poll_s=0.05).run())
    try:
        async with AsyncClient(live_rt.url, acme) as sdk:
            await sdk.deploy("echo", agent_archive(tmp_path))
            await sdk.create_webhook("echo", receiver.url, events=["execution.succeeded"], secret=secret)
            ex = await sdk.invoke_async("echo", "hello", user="cust-1")
            await until(lambda: receiver.delivered(), "the retried webhook arrives")
    finally:
        dispatcher.cancel()
        receiver.close()

    attempts = [(h, b) for h, b, _ in receiver.requests]
    assert len(attempts) >= 2
    events = [verify_webhook(secret, body, headers) for headers, body in attempts]
    ids = {e.id for e in events}
    assert len(ids) == 1 and ids == {attempts[0][0]["webhook-id"]}, ids

    handled: list[str] = []
    seen: set[str] = set()
    for e in events:  # the receiver of docs/sdk.md
        if e.id in seen:
            continue
        seen.add(e.id)
        handled.append(e["data"]["execution_id"])
    assert handled == [ex["id"]]

    # Still the plain event dict callers used before.
    event = events[0]
    assert isinstance(event, dict) and isinstance(event, WebhookEvent)
    assert set(event) == {"type", "timestamp", "data"} and event["type"] == "execution.succeeded"
    assert json.loads(json.dumps(event)) == dict(event)


def test_the_id_is_the_signed_one() -> None:
    secret = new_webhook_secret()
    body = json.dumps({"type": "execution.succeeded", "timestamp": 1, "data": {}})
    headers = sign(secret, "msg_abc", int(time.time()), body)
    assert verify_webhook(secret, body.encode(), headers).id == "msg_abc"
    with pytest.raises(WebhookSignatureError):  # another id under the same signature does not check out
        verify_webhook(secret, body.encode(), {**headers, "webhook-id": "msg_other"})
