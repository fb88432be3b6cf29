"""The instances of each tenant being made on this host, and a hold on making more: an online backup lists a
tenant's instances and copies its store with none made between the two (runtime/backup.py)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator


class NewInstances:
    """Counts the instance records being created per tenant; ``held`` makes the next ones wait."""

    def __init__(self) -> None:
        self._making: dict[str, int] = {}
        self._held: dict[str, asyncio.Future[None]] = {}

    @contextlib.asynccontextmanager
    async def making(self, tenant_id: str) -> AsyncIterator[None]:
        """Around the creation of one instance's record: waits first while the tenant's new instances are held."""
        while (hold := self._held.get(tenant_id)) is not None:
            await asyncio.shield(hold)
        self._making[tenant_id] = self._making.get(tenant_id, 0) + 1
        try:
            yield
        finally:
            left = self._making[tenant_id] - 1
            if left:
                self._making[tenant_id] = left
            else:
                del self._making[tenant_id]

    @contextlib.asynccontextmanager
    async def held(self, tenant_id: str) -> AsyncIterator[None]:
        """No instance of the tenant is created during the block: records being created as it begins are finished
        first, new ones wait for its end. One holder per tenant at a time (the host runs one backup at a time)."""
        if tenant_id in self._held:
            raise RuntimeError(f"the new instances of tenant {tenant_id} are held already")
        hold: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._held[tenant_id] = hold
        try:
            while self._making.get(tenant_id):
                await asyncio.sleep(0.005)
            yield
        finally:
            del self._held[tenant_id]
            hold.set_result(None)
