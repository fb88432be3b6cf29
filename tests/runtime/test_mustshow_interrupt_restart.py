"""An interrupt survives the sandbox sleeping and the host being closed and opened again on the same data dir.

The turn runs two steps, reaches ``ctx.interrupt`` and ends ``waiting``. The instance sleeps, the host
closes, a new ``Host`` opens on the same data dir and the human answers through the new host's
runtime: the run resumes after the interrupt with that answer, and the steps before it do not run again.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moorage.config import Config
from moorage.durable import DurableEngine
from moorage.runtime.host import Host
from moorage.store import EntityKey, Scope
from tests.runtime.conftest import write_agent

AGENT = '''
import json, os

def note(name):
    with open("/work/exec.log", "a") as f:
        f.write(json.dumps({"turn": CTX_TURN[0], "step": name}) + "\\n")

CTX_TURN = [None]

async def on_message(ctx, message):
    CTX_TURN[0] = ctx.turn_id

    def collect():
        note("collect")
        return {"items": message.split()[1:]}

    def price(order):
        note("price")
        return {"total": 10 * len(order["items"])}

    order = await ctx.step("collect", collect)
    quote = await ctx.step("price", price, order)
    answer = await ctx.interrupt({"question": "ship %d items for %d?" % (len(order["items"]), quote["total"])})

    def ship():
        note("ship")
        return "shipped"

    shipped = await ctx.step("ship", ship)
    return "%s %s total %d, approved by: %s" % (shipped, ",".join(order["items"]), quote["total"], answer)
'''


async def _stop_sandboxes(host: Host) -> None:
    for sid in await host.driver.list():
        try:
            await (await host.driver.open(sid)).stop()
        except Exception:  # noqa: BLE001 - best-effort cleanup
            pass


def _executions(cfg: Config) -> list[dict[str, str]]:
    out = []
    for log in cfg.sandboxes_dir.glob("*/layer/work/exec.log"):
        out += [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    return out


@pytest.mark.timeout(170)
async def test_interrupt_survives_sleep_and_host_restart(tmp_path: Path) -> None:
    agent = write_agent(tmp_path / "shipper", "shipper", AGENT)
    cfg = Config(data_dir=tmp_path / "data", sandbox_driver="process")

    host = Host.open(cfg)
    await host.start()
    try:
        _, key = host.store.operator.create_tenant("acme")
        principal = host.store.authenticate(key.secret)
        await host.runtime.deploy(principal, agent)
        who = EntityKey("shipper", "ada", "orders")
        first = await host.runtime.invoke(principal, who, "ship apples pears plums")
        assert first.status == "waiting"
        assert first.interrupt == {"question": "ship 3 items for 30?"}
        ts = host.store.tenant(principal)
        assert await host.manager.sleep(ts, Scope.for_user("shipper", "ada"))
        (rec,) = ts.sandboxes.list(agent_id="shipper")
        assert rec.state == "sleeping"
    except BaseException:
        await _stop_sandboxes(host)
        raise
    finally:
        await host.close()

    # The first host is gone; nothing of it is in this process any more but the data dir.
    assert [e["step"] for e in _executions(cfg)] == ["collect", "price"]

    host2 = Host.open(cfg)
    await host2.start()
    try:
        principal2 = host2.store.authenticate(key.secret)
        ts2 = host2.store.tenant(principal2)
        assert ts2.runs.get(first.run_id).status == "waiting"  # recovery on start left the waiting run alone
        assert DurableEngine(ts2).waiting_for(first.run_id) == {"question": "ship 3 items for 30?"}
        (rec,) = ts2.sandboxes.list(agent_id="shipper")
        assert rec.state == "sleeping"

        done = await host2.runtime.answer(principal2, first.run_id, "Ada, ops lead")
        assert done.status == "done"
        assert done.reply == "shipped apples,pears,plums total 30, approved by: Ada, ops lead"
        run = ts2.runs.get(first.run_id)
        assert run.status == "succeeded"
        # The steps before the interrupt ran once, in the first host; only the step after it ran now.
        execs = _executions(cfg)
        assert [e["step"] for e in execs] == ["collect", "price", "ship"]
        assert {e["turn"] for e in execs} == {first.run_id}
        hist = [(h.kind, h.name, h.status) for h in DurableEngine(ts2).history(first.run_id)]
        assert hist == [("step", "collect", "succeeded"), ("step", "price", "succeeded"),
                        ("interrupt", "approval", "answered"), ("step", "ship", "succeeded")]
    finally:
        await _stop_sandboxes(host2)
        await host2.close()
