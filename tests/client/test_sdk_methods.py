"""The SDK methods no other test drives, each against a real server (uvicorn over the real runtime and store):
listing agents, deployments, sessions, events, facts, workflows, webhooks and keys; secrets of an agent and of one
end-user; share links to a user's app; the fleet's summary. Each answer is checked against what was done."""

from __future__ import annotations

import asyncio
import io
import tarfile
from pathlib import Path

import httpx
import pytest

from moorage import AsyncClient
from moorage.client import AuthError, NotFound
from moorage.store import Store
from moorage.webhooks import Dispatcher, RetrySchedule
from tests.api.conftest import agent_archive
from tests.api.test_async_webhooks import Receiver, until

WEB_AGENT = "async def on_message(ctx, message):\n    return 'web: ' + message\n"


def web_archive() -> bytes:
    """An agent that declares an app port (a share link needs one); its app is never started here."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in (("moorage.toml", '[agent]\nname = "web"\nentry = "agent.py"\nports = [8080]\n'
                                            '[agent.lifecycle]\nusers = "auto"\n'),
                           ("agent.py", WEB_AGENT)):
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


async def test_listing_and_memory_methods(live_rt, store: Store, acme: str, tmp_path: Path) -> None:
    async with AsyncClient(live_rt.url, acme) as sdk:
        await sdk.deploy("echo", agent_archive(tmp_path))
        await sdk.deploy("echo", agent_archive(tmp_path, version="2"))
        assert [a["name"] for a in (await sdk.list_agents())["data"]] == ["echo"]
        agent = await sdk.get_agent("echo")
        deployments = (await sdk.list_deployments("echo"))["data"]
        assert sorted(d["number"] for d in deployments) == [1, 2]
        assert agent["live_deployment"] == next(d["id"] for d in deployments if d["number"] == 2)

        assert (await sdk.invoke("echo", "my cat is called Miso", user="ada", session="s1"))["reply"].endswith(
            "my cat is called Miso")
        sessions = (await sdk.list_sessions("echo", user="ada"))["data"]
        assert "s1" in [s.get("session") or s.get("id") for s in sessions], sessions
        events = (await sdk.list_events("echo", "ada", session="s1"))["data"]
        assert any("Miso" in str(e) for e in events), events
        found = (await sdk.search_events("echo", "ada", "cat name", session="s1", k=3))["data"]
        assert found and "Miso" in str(found[0]), found

        fact = await sdk.add_fact("echo", "ada", "ada", "pet", "Miso", text="ada's cat is Miso")
        assert fact["action"] == "inserted" and fact["fact"]["value"] == "Miso" and fact["previous"] is None
        facts = (await sdk.list_facts("echo", "ada", subject="ada"))["data"]  # the extractor learned others
        assert [(f["subject"], f["attribute"], f["value"]) for f in facts] == [("ada", "pet", "Miso")]

        ex = await sdk.invoke_async("echo", "later", user="ada")
        done = await sdk.wait_execution(ex["id"], timeout_s=60, poll_s=0.05)
        assert (await sdk.get_execution(ex["id"]))["status"] == done["status"] == "succeeded"

        waiting = await sdk.invoke("echo", "approve", user="ada")
        runs = (await sdk.list_workflows(status="waiting", agent="echo"))["data"]
        assert [r["id"] for r in runs] == [waiting["run_id"]]
        assert (await sdk.get_workflow(waiting["run_id"]))["run"]["status"] == "waiting"
        await sdk.cancel(waiting["run_id"])
        assert (await sdk.list_workflows(status="waiting"))["data"] == []

        box = (await sdk.list_sandboxes(agent="echo"))["data"][0]
        assert (await sdk.get_sandbox(box["id"]))["id"] == box["id"]


async def test_webhook_and_key_methods(live_rt, store: Store, acme: str, tmp_path: Path) -> None:
    receiver = Receiver()
    dispatcher = asyncio.create_task(Dispatcher(store, schedule=RetrySchedule((0.2,) * 4), poll_s=0.05).run())
    try:
        async with AsyncClient(live_rt.url, acme) as sdk:
            await sdk.deploy("echo", agent_archive(tmp_path))
            hook = await sdk.create_webhook("echo", receiver.url, events=["execution.succeeded"])
            assert [h["id"] for h in (await sdk.list_webhooks("echo"))["data"]] == [hook["id"]]
            assert (await sdk.get_webhook("echo", hook["id"]))["url"] == receiver.url
            await sdk.invoke_async("echo", "hello", user="ada")
            await until(lambda: len(receiver.delivered()) == 1, "the webhook arrives")
            for _ in range(600):
                (delivery,) = (await sdk.list_deliveries("echo", hook["id"]))["data"]
                if delivery["status"] != "pending":
                    break
                await asyncio.sleep(0.05)
            assert (await sdk.get_delivery("echo", hook["id"], delivery["id"]))["status"] == "delivered"
            await sdk.replay_delivery("echo", hook["id"], delivery["id"])
            await until(lambda: len(receiver.delivered()) == 2, "the replay is sent")
            assert receiver.delivered()[0][1] == receiver.delivered()[1][1]  # the same event, byte for byte
            await sdk.delete_webhook("echo", hook["id"])
            assert (await sdk.list_webhooks("echo"))["data"] == []

            key = await sdk.create_key(["read"], label="audit")
            assert key["id"] in [k["id"] for k in (await sdk.list_keys())["data"]]
            async with AsyncClient(live_rt.url, key["secret"], max_retries=0) as reader:
                assert [a["name"] for a in (await reader.list_agents())["data"]] == ["echo"]
                await sdk.revoke_key(key["id"])
                with pytest.raises(AuthError):
                    await reader.list_agents()
    finally:
        dispatcher.cancel()
        await asyncio.gather(dispatcher, return_exceptions=True)
        receiver.close()


async def test_secret_share_link_and_fleet_methods(live_rt, acme: str, globex: str, tmp_path: Path) -> None:
    async with AsyncClient(live_rt.url, acme) as sdk, AsyncClient(live_rt.url, globex, max_retries=0) as other:
        await sdk.deploy("web", web_archive())
        first = await sdk.set_secret("web", "API_TOKEN", "s3cret-1")
        second = await sdk.set_secret("web", "API_TOKEN", "s3cret-2")
        assert (first["version"], second["version"], second["user"]) == (1, 2, None)
        await sdk.put_user("web", "ada")  # one of its users: her listing stays a list once her secret is gone
        mine = await sdk.set_secret("web", "OAUTH", "ada-token", user="ada")
        assert mine["user"] == "ada"
        listed = (await sdk.list_secrets("web"))["data"]
        assert [(s["name"], s["version"]) for s in listed] == [("API_TOKEN", 2)]
        assert [s["name"] for s in (await sdk.list_secrets("web", user="ada"))["data"]] == ["OAUTH"]
        assert "s3cret" not in str(listed) and "ada-token" not in str(await sdk.list_secrets("web", user="ada"))
        await sdk.delete_secret("web", "OAUTH", user="ada")
        assert (await sdk.list_secrets("web", user="ada"))["data"] == []
        with pytest.raises(NotFound):  # another tenant has no agent "web": nothing of acme's is reachable
            await other.list_secrets("web")

        await sdk.put_user("web", "ada")
        link = await sdk.create_share_link("web", "ada", ttl_s=600, label="for bob")
        assert link["url"] == f"/v1/shared/{link['token']}/" and link["expires_at"] - link["created_at"] == pytest.approx(600)
        (listed_link,) = (await sdk.list_share_links("web", "ada"))["data"]
        assert listed_link["id"] == link["id"] and "token" not in listed_link
        with pytest.raises(NotFound):
            await other.list_share_links("web", "ada")
        revoked = await sdk.revoke_share_link("web", "ada", link["id"])
        assert revoked["revoked_at"] is not None
        async with httpx.AsyncClient(base_url=live_rt.url) as anyone:  # a revoked link opens nothing
            assert (await anyone.get(link["url"])).status_code in (403, 404, 410)
        with pytest.raises(NotFound):  # a user who does not exist gets no link
            await sdk.create_share_link("web", "nobody")

        await sdk.invoke("web", "hi", user="ada")
        fleet = await sdk.fleet()
        assert fleet["total"] == 1 and [i["user"] for i in fleet["instances"]] == ["ada"]
        assert (await other.fleet())["total"] == 0  # another tenant's view holds none of acme's
