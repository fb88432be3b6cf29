"""How the store half of a checkpoint and an awake turn grow with a user's history.

``python bench/timetravel/growth.py [--turns 500] [--every 100]``: one user of the time-travel bench's agent
(each turn writes a file, learns a fact, records an event, journals a step; automatic checkpoints on), process
driver, SQLite. After every ``--every`` turns: the store half of a checkpoint (``Checkpoints.take`` on the
instance, p50 of 20) and the turn p50 of those turns. Last line:
``timetravel growth: store half X -> Y ms, turn p50 A -> B ms (N -> M turns)``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

from moorage.config import Config
from moorage.lifecycle.manager import InstanceManager
from moorage.llm import gateway_from_config
from moorage.runtime.runtime import Runtime
from moorage.sandbox import get_driver
from moorage.store import EntityKey, open_store
from moorage.store.repos.checkpoints import Checkpoints

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import AGENT_PY  # noqa: E402  (the same agent as the time-travel bench)


async def main(turns: int, every: int) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="moorage-growth-"))
    cfg = Config(data_dir=tmp / "data", sandbox_driver="process")
    store = open_store(cfg)
    principal = store.authenticate(store.operator.create_tenant("bench")[1].secret)
    driver = get_driver(cfg)
    manager = InstanceManager(store, driver)
    await manager.start()
    rt = Runtime(cfg, store, driver, gateway_from_config(cfg), manager)
    rows: list[tuple[int, float, float]] = []
    try:
        src = tmp / "agent"
        src.mkdir()
        (src / "moorage.toml").write_text('[agent]\nname = "tt"\nentry = "agent.py"\n[agent.timetravel]\nauto = true\n'
                                          '[agent.lifecycle]\nusers = "auto"\n')
        (src / "agent.py").write_text(AGENT_PY)
        await rt.deploy(principal, src)
        repo = Checkpoints(store.tenant(principal))
        lat: list[float] = []
        for i in range(1, turns + 1):
            t0 = time.perf_counter()
            await rt.invoke(principal, EntityKey("tt", "ada"), f"turn {i}")
            lat.append(time.perf_counter() - t0)
            if i % every == 0:
                await rt.timetravel.list(principal, "tt", "ada")  # waits for the turn's own checkpoint
                takes = []
                for _ in range(20):
                    t0 = time.perf_counter()
                    repo.take("tt", "ada", kind="manual")
                    takes.append(time.perf_counter() - t0)
                rows.append((i, statistics.median(takes) * 1e3, statistics.median(lat[-every:]) * 1e3))
                print(f"turns {i}: store half p50 {rows[-1][1]:.2f} ms; turn p50 (last {every}) {rows[-1][2]:.1f} ms",
                      flush=True)
    finally:
        await manager.close()
        for sid in await driver.list():
            sb = await driver.open(sid)
            if sb.state.value == "running":
                await sb.stop()
        await driver.close()
        store.close()
    (a, sa, ta), (b, sb_, tb) = rows[0], rows[-1]
    print(f"timetravel growth: store half {sa:.1f} -> {sb_:.1f} ms, turn p50 {ta:.0f} -> {tb:.0f} ms ({a} -> {b} turns)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=500)
    ap.add_argument("--every", type=int, default=100)
    args = ap.parse_args()
    asyncio.run(main(args.turns, args.every))
