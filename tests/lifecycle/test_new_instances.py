"""NewInstances (lifecycle/new_instances.py): while a tenant's new instances are held, the creation of a record
waits; the hold itself waits for records being created as it begins; other tenants are not held."""

from __future__ import annotations

import asyncio

from moorage.lifecycle.new_instances import NewInstances


def test_a_hold_waits_for_records_being_made_and_holds_the_next_ones_of_its_tenant_only() -> None:
    async def main() -> None:
        new = NewInstances()
        order: list[str] = []
        release_first = asyncio.Event()

        async def make(tenant: str, name: str, until: asyncio.Event | None = None) -> None:
            async with new.making(tenant):
                order.append(f"{name} made")
                if until is not None:
                    await until.wait()
            order.append(f"{name} done")

        first = asyncio.create_task(make("t1", "first", release_first))
        await asyncio.sleep(0.01)

        async def hold() -> None:
            async with new.held("t1"):
                order.append("held")
                second = asyncio.create_task(make("t1", "second"))
                await make("t2", "other")  # another tenant's is made meanwhile
                await asyncio.sleep(0.05)
                assert not second.done()
                order.append("let go")
            await second

        holder = asyncio.create_task(hold())
        await asyncio.sleep(0.05)
        assert order == ["first made"]  # the hold waits for the record being made
        release_first.set()
        await holder
        await first
        assert order == ["first made", "first done", "held", "other made", "other done", "let go", "second made",
                         "second done"]

    asyncio.run(main())
