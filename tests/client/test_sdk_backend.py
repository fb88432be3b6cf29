"""A product backend written only against the SDK, over a real server: users by external id, an async turn,
its signed webhook verified with the SDK helper, the execution, pages, streaming, errors; sync and async."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from moorage import AsyncClient, Client
from moorage.client import NotFound, RateLimited, WebhookSignatureError, verify_webhook
from moorage.store import Store
from moorage.webhooks import Dispatcher, RetrySchedule
from tests.api.conftest import agent_archive
from tests.api.test_async_webhooks import Receiver, until


async def test_backend_integration_through_the_sdk(live_rt, store: Store, acme: str, tmp_path: Path):
    receiver = Receiver()
    dispatcher = asyncio.create_task(Dispatcher(store, schedule=RetrySchedule((0.2,) * 4), poll_s=0.05).run())
    try:
        async with AsyncClient(live_rt.url, acme) as sdk:
            await sdk.deploy("echo", agent_archive(tmp_path))
            first = await sdk.put_user("echo", "cust-1", metadata={"plan": "pro"})
            second = await sdk.put_user("echo", "cust-1", metadata={"plan": "pro"})
            assert first["id"] == second["id"] == "cust-1" and first["created_at"] == second["created_at"]
            assert [u["id"] async for u in sdk.paginate(sdk.list_users, "echo")] == ["cust-1"]

            hook = await sdk.create_webhook("echo", receiver.url, events=["execution.succeeded"])
            ex = await sdk.invoke_async("echo", "hello", user="cust-1")
            assert ex["status"] in ("queued", "running", "succeeded")
            await until(lambda: receiver.delivered(), "the webhook arrives")
            headers, body = receiver.delivered()[0]
            event = verify_webhook(hook["secret"], body, headers)
            assert event["type"] == "execution.succeeded" and event["data"]["execution_id"] == ex["id"]
            with pytest.raises(WebhookSignatureError):
                verify_webhook(hook["secret"], body + b" ", headers)

            done = await sdk.wait_execution(ex["id"], timeout_s=60, poll_s=0.05)
            assert done["status"] == "succeeded" and done["reply"] == "echo: hello"
            # The receiver has the webhook before the dispatcher records its answer: wait for the record.
            for _ in range(600):
                deliveries = (await sdk.list_deliveries("echo", hook["id"]))["data"]
                if [d["status"] for d in deliveries] != ["pending"]:
                    break
                await asyncio.sleep(0.05)
            assert [d["status"] for d in deliveries] == ["delivered"]

            events = [e async for e in sdk.stream("echo", "stream x y", user="cust-1")]
            assert "".join(e["data"]["data"] for e in events if e["event"] == "token") == "x y "
            assert events[-1]["event"] == "done" and events[-1]["data"]["reply"] == "streamed"

            waiting = await sdk.invoke("echo", "approve", user="cust-1")
            assert waiting["status"] == "waiting"
            assert (await sdk.answer(waiting["run_id"], "yes"))["reply"] == "draft-1 -> yes"

            with pytest.raises(NotFound) as missing:
                await sdk.get_user("echo", "nobody")
            assert missing.value.status == 404 and missing.value.trace_id
            assert (await sdk.usage(user="cust-1"))["since"] == 0.0
            # A per-user compute cap: the turn over it is a 429 naming the cap, and the instance is put to sleep.
            await sdk.put_user("echo", "cust-1", limits={"compute_seconds_per_day": 1.5})
            assert (await sdk.get_user("echo", "cust-1"))["instance"]["state"] == "running"
            await asyncio.sleep(1.6)  # the instance stays awake (default policy) and uses up the cap
            async with AsyncClient(live_rt.url, acme, max_retries=0) as no_retry:
                with pytest.raises(RateLimited) as capped:
                    await no_retry.invoke("echo", "more", user="cust-1")
            assert capped.value.code == "cap-exceeded" and "compute_seconds_per_day" in capped.value.detail
            assert capped.value.retry_after and capped.value.retry_after >= 1
            assert (await sdk.get_user("echo", "cust-1"))["instance"]["state"] == "sleeping"
            usage = (await sdk.usage(agent="echo", user="cust-1"))["totals"]
            spans = [s for s in (await sdk.list_spans(limit=500))["data"] if s["attrs"].get("user") == "cust-1"
                     and s["name"] in ("lifecycle.provisioned", "lifecycle.woke", "lifecycle.slept")]
            awake = max(s["end_ts"] for s in spans if s["name"] == "lifecycle.slept") - \
                min(s["end_ts"] for s in spans if s["name"] != "lifecycle.slept")
            assert abs(usage["compute_seconds"] - awake) <= 0.05 * awake, (usage, awake)

            gone = await sdk.delete_user("echo", "cust-1")
            assert gone["deleted"] is True
    finally:
        dispatcher.cancel()
        await asyncio.gather(dispatcher, return_exceptions=True)
        receiver.close()


async def test_sync_client_pages_and_errors(live_rt, acme: str, tmp_path: Path):
    def backend() -> None:
        with Client(live_rt.url, acme) as sdk:
            package = tmp_path / "echo.tar.gz"
            package.write_bytes(agent_archive(tmp_path))
            assert sdk.deploy("echo", package)["number"] == 1  # a ready tar.gz, as docs/sdk.md says
            with pytest.raises(FileNotFoundError, match="no agent directory or package"):
                sdk.deploy("echo", tmp_path / "missing")
            for i in range(5):
                sdk.put_user("echo", f"u{i}", metadata={"n": i, "even": i % 2 == 0})
            assert [u["id"] for u in sdk.paginate(sdk.list_users, "echo", limit=2)] == [f"u{i}" for i in range(5)]
            assert [u["id"] for u in sdk.list_users("echo", metadata={"even": True})["data"]] == ["u0", "u2", "u4"]
            assert sdk.invoke("echo", "hi", user="u1")["reply"] == "echo: hi"
            events = list(sdk.stream("echo", "stream p q", user="u1"))
            assert [e["event"] for e in events][-1] == "done" and events[-1]["data"]["reply"] == "streamed"
            ex = sdk.invoke_async("echo", "later", user="u2", idempotency_key="job-7")
            assert sdk.invoke_async("echo", "later", user="u2", idempotency_key="job-7")["id"] == ex["id"]
            assert sdk.wait_execution(ex["id"], timeout_s=60, poll_s=0.05)["reply"] == "echo: later"
            key = sdk.create_key(["read"], label="dashboard", agent="echo")
            assert key["agent"] == "echo" and key["secret"].startswith("mrg_")
        with Client(live_rt.url, key["secret"]) as reader:
            assert reader.get_user("echo", "u3")["metadata"] == {"n": 3, "even": False}
            with pytest.raises(Exception) as refused:
                reader.put_user("echo", "u9")
            assert getattr(refused.value, "status", None) == 403

    await asyncio.to_thread(backend)
