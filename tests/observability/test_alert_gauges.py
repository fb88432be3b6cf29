"""What an operator alerts on is on a live host's ``/metrics``: background loops that keep failing, webhook
deliveries a dead receiver holds back, the store's reachability, and this host's awake instances against its
limits."""

from __future__ import annotations

import asyncio

import pytest

from moorage.log import FailingRounds, get_logger
from tests.observability.conftest import LiveHost, archive, value

pytestmark = pytest.mark.timeout(240)


async def test_each_background_loop_shows_its_failed_rounds(live_host: LiveHost) -> None:
    samples = await live_host.scrape()
    # The host's own loops are there from the start, at 0 while they work.
    loops = {dict(ls)["loop"]: v for (n, ls), v in samples.items() if n == "moorage_background_failing_rounds"}
    assert loops.get("webhook round") == 0 and loops.get("idle loop pass") == 0, loops
    # A loop whose rounds keep failing (its store unreachable, say) shows how many, and for how long.
    failing = FailingRounds(get_logger("tests.loop"), "a loop of this test")
    for _ in range(3):
        failing.failed(ConnectionError("object store unreachable"))
    await asyncio.sleep(0.05)
    samples = await live_host.scrape()
    assert value(samples, "moorage_background_failing_rounds", loop="a loop of this test") == 3
    assert value(samples, "moorage_background_failing_seconds", loop="a loop of this test") > 0
    failing.ok()
    samples = await live_host.scrape()
    assert value(samples, "moorage_background_failing_rounds", loop="a loop of this test") == 0


async def test_deliveries_to_a_dead_receiver_and_awake_instances_show(live_host: LiveHost) -> None:
    async with live_host.client() as c:
        r = await c.post("/v1/agents/echo/deployments", content=archive(), headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        hook = (await c.post("/v1/agents/echo/webhooks", json={"url": "http://127.0.0.1:9/hooks"})).json()
        r = await c.post("/v1/agents/echo/invoke?async=true", json={"message": "hi", "user": "ada"})
        assert r.status_code == 202, r.text
        for _ in range(400):  # until the delivery loop tried (and failed) once
            got = (await c.get(f"/v1/agents/echo/webhooks/{hook['id']}/deliveries")).json()["data"]
            if got and got[0]["attempts"] >= 1:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"the delivery was never tried: {got}")
    samples = await live_host.scrape()
    assert value(samples, "moorage_store_up") == 1
    held = value(samples, "moorage_webhook_deliveries_retrying") + value(samples, "moorage_webhook_deliveries_failed")
    assert held == 1, {k: v for k, v in samples.items() if "webhook" in k[0]}
    assert value(samples, "moorage_awake_instances") == 1
    assert value(samples, "moorage_awake_instances_limit") == 8  # max_awake_instances
    assert value(samples, "moorage_awake_ram_mib_limit") == -1  # max_awake_ram_mib unset: no limit
    assert ("moorage_turns_pending", ()) in samples and ("moorage_turn_oldest_pending_seconds", ()) in samples


def test_every_background_loop_is_named_by_a_literal() -> None:
    """The ``loop`` label is a loop's name: written in the code, so no tenant or request can add a value."""
    import ast
    from pathlib import Path

    import moorage

    named = 0
    for path in Path(moorage.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "FailingRounds":
                assert len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                    and isinstance(node.args[1].value, str), f"{path}:{node.lineno}: a loop's name must be a literal"
                named += 1
    assert named >= 10, named


BUSY = '''
import asyncio

async def on_message(ctx, message):
    if message == "busy":
        await asyncio.sleep(60)
    return "done: " + message
'''


async def test_an_async_turn_held_back_shows_as_queued(tmp_path) -> None:  # noqa: ANN001
    from tests.observability.conftest import start_host

    # One awake instance per tenant: while ada's turn runs, bob's async turn is refused "not now" and waits.
    async with start_host(tmp_path, max_awake_per_tenant=1) as live, live.client() as c:
        r = await c.post("/v1/agents/busy/deployments", content=archive("busy", BUSY),
                         headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        ada = (await c.post("/v1/agents/busy/invoke?async=true", json={"message": "busy", "user": "ada"})).json()
        for _ in range(400):
            ada_view = (await c.get(f"/v1/executions/{ada['id']}")).json()
            if ada_view["status"] == "running":
                break
            await asyncio.sleep(0.05)
        bob = (await c.post("/v1/agents/busy/invoke?async=true", json={"message": "hi", "user": "bob"})).json()
        await asyncio.sleep(0.5)
        assert (await c.get(f"/v1/executions/{bob['id']}")).json()["status"] == "queued"
        samples = await live.scrape()
        assert value(samples, "moorage_async_turns_queued") == 1
        assert value(samples, "moorage_async_turn_oldest_queued_seconds") > 0
        assert value(samples, "moorage_turns_running") + value(samples, "moorage_turns_pending") == 1  # ada's
        await c.post(f"/v1/workflows/{ada_view['run_id']}/cancel")
        await c.post(f"/v1/executions/{bob['id']}/cancel")
