"""An agent's retention through the SDK (sync and async), over a real server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from moorage import AsyncClient, Client
from moorage.client import NotFound
from tests.api.conftest import agent_archive


async def test_retention_through_the_sdk(live_rt, acme: str, tmp_path: Path):
    async with AsyncClient(live_rt.url, acme) as sdk:
        await sdk.deploy("echo", agent_archive(tmp_path))
        assert await sdk.get_retention("echo") == {"agent": "echo", "ttl_s": None, "zero_retention": False}
        assert (await sdk.set_retention("echo", 3600))["ttl_s"] == 3600

    def sync() -> None:
        with Client(live_rt.url, acme) as sdk:
            assert sdk.get_retention("echo")["ttl_s"] == 3600
            assert sdk.set_retention("echo", None) == {"agent": "echo", "ttl_s": None, "zero_retention": False}
            with pytest.raises(NotFound):
                sdk.get_retention("nobody")

    await asyncio.to_thread(sync)
