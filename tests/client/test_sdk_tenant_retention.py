"""The tenant's retention and an agent's zero retention through the SDK (sync and async), over a real server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from moorage import AsyncClient, Client
from moorage.client import AuthError, BadRequest
from tests.api.conftest import agent_archive

#: A tenant that never set a TTL: everything kept, but traces and webhooks (30 days: DEFAULT_TTLS).
NONE = {"session": None, "user": None, "workflow": None, "executions": None, "usage": None, "traces": 30 * 86400.0,
        "webhooks": 30 * 86400.0}


async def test_tenant_retention_and_zero_retention_through_the_sdk(live_rt, acme: str, tmp_path: Path):
    async with AsyncClient(live_rt.url, acme) as sdk:
        await sdk.deploy("echo", agent_archive(tmp_path))
        assert await sdk.get_tenant_retention() == {"ttl_s": NONE, "agents": []}
        got = await sdk.set_tenant_retention({"session": 86400})
        assert got["ttl_s"] == {**NONE, "session": 86400}
        zero = await sdk.set_retention("echo", zero_retention=True)
        assert zero == {"agent": "echo", "ttl_s": None, "zero_retention": True}
        assert (await sdk.get_tenant_retention())["agents"] == [zero]
        with pytest.raises(BadRequest):
            await sdk.set_tenant_retention({"events": 60})
        read_key = (await sdk.create_key(["read"]))["secret"]

    def sync() -> None:
        with Client(live_rt.url, acme) as sdk:
            assert sdk.set_tenant_retention({"session": None, "user": 3600})["ttl_s"] == {**NONE, "user": 3600}
            assert sdk.set_retention("echo", zero_retention=False)["zero_retention"] is False
            assert sdk.get_tenant_retention()["agents"] == []
            with pytest.raises(BadRequest):
                sdk.set_retention("echo", 60, zero_retention=True)
        with Client(live_rt.url, read_key) as reader:
            assert reader.get_tenant_retention()["ttl_s"]["user"] == 3600
            with pytest.raises(AuthError):
                reader.set_tenant_retention({"user": None})

    await asyncio.to_thread(sync)
