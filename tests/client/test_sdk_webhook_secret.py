"""`new_webhook_secret()` makes a secret the server takes for `create_webhook(secret=...)` and `verify_webhook` checks
deliveries with: a backend keeps it before subscribing, so a restart (or a lost answer) never leaves it without one."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

from moorage import AsyncClient
from moorage.client import new_webhook_secret, verify_webhook
from moorage.store import Store
from moorage.webhooks import Dispatcher, RetrySchedule
from tests.api.conftest import agent_archive
from tests.api.test_async_webhooks import Receiver, until


async def test_a_secret_made_here_signs_the_servers_deliveries(live_rt, store: Store, acme: str, tmp_path: Path):
    secret = new_webhook_secret()
    assert secret.startswith("whsec_") and len(base64.b64decode(secret[6:])) == 32 and secret != new_webhook_secret()
    receiver = Receiver()
    dispatcher = asyncio.create_task(Dispatcher(store, schedule=RetrySchedule((0.2,) * 4), poll_s=0.05).run())
    try:
        async with AsyncClient(live_rt.url, acme) as sdk:
            await sdk.deploy("echo", agent_archive(tmp_path))
            hook = await sdk.create_webhook("echo", receiver.url, events=["execution.succeeded"], secret=secret)
            assert hook["secret"] == secret
            ex = await sdk.invoke_async("echo", "hello", user="cust-1")
            await until(lambda: receiver.delivered(), "the webhook arrives")
            headers, body = receiver.delivered()[0]
            assert verify_webhook(secret, body, headers)["data"]["execution_id"] == ex["id"]
    finally:
        dispatcher.cancel()
