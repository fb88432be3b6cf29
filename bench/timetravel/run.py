"""Time-travel benchmark: the cost of checkpointing a whole agent instance after each turn, of rolling it back,
of forking it, and the storage per checkpoint — on one sandbox driver, through the runtime (SQLite store).

The agent writes a small file, learns a fact, records an event and journals a step every turn (what the
issue's must-show turns do), with automatic checkpoints on (``[agent.timetravel] auto = true``).

Two phases. Through ``moorage up`` and HTTP: the same agent deployed twice, automatic checkpoints on and off,
turns alternating between the two, each turn followed by a listing of its user's checkpoints (which waits for
a checkpoint still being taken): the reply path's added cost is the difference of the two p50s, and how long
after the reply its checkpoint is done is the listing's extra time. In process: the checkpoint's own duration
(both halves timed inside the runtime; on the micro-VM driver until the guest runs again, its files written
behind it), rollback, fork and storage.

    .venv/bin/python bench/timetravel/run.py [--driver process|microvm] [--turns 30] [--images DIR] [--quick]

``--images``: where the micro-VM guest image is built or found (default: the default data directory's, the one
``moorage up`` built), so a run does not build one of its own.

Writes bench/results/latest/timetravel-<driver>.{md,json}; the last line printed is the headline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from moorage.cli.up import tar_dir
from moorage.config import Config
from moorage.devservices.fleet import LocalHost
from moorage.lifecycle.manager import InstanceManager
from moorage.llm import gateway_from_config
from moorage.runtime.runtime import Runtime
from moorage.sandbox import get_driver
from moorage.store import EntityKey, open_store
from moorage.store.repos.checkpoints import Checkpoints

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "store"))
from report import latency_summary  # noqa: E402  (bench/store/report.py: what the areas share)

OUT = ROOT / "bench" / "results" / "latest"
AGENT_PY = '''\
async def on_message(ctx, message):
    n = int(message.split()[1])
    ctx.files.write(f"notes/{n}.txt", f"note {n}")
    await ctx.memory.learn("user", "last_turn", str(n), f"the last turn was {n}")
    await ctx.memory.remember(f"milestone {n}")
    await ctx.step(f"side-{n}", lambda: n)
    return f"done {n}"
'''


class Timed:
    """Wraps the two halves of a checkpoint to time them (the runtime's own objects, not copies)."""

    def __init__(self, rt: Runtime) -> None:
        self.whole: list[float] = []
        self.store: list[float] = []
        tt = rt.timetravel
        take = tt._take

        async def timed_take(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await take(*a, **kw)
            finally:
                self.whole.append(time.perf_counter() - t0)

        tt._take = timed_take  # type: ignore[method-assign]
        store_take = Checkpoints.take

        def timed_store(repo: Checkpoints, *a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return store_take(repo, *a, **kw)
            finally:
                self.store.append(time.perf_counter() - t0)

        Checkpoints.take = timed_store  # type: ignore[method-assign]
        # What a rollback is made of: the sandbox's rollback and the store's (besides its before-rollback checkpoint).
        self.vm_rollback: list[float] = []
        self.store_rollback: list[float] = []
        vm_rollback = tt._vm_rollback

        async def timed_vm_rollback(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await vm_rollback(*a, **kw)
            finally:
                self.vm_rollback.append(time.perf_counter() - t0)

        tt._vm_rollback = timed_vm_rollback  # type: ignore[method-assign]
        store_rollback = Checkpoints.rollback

        def timed_store_rollback(repo: Checkpoints, *a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return store_rollback(repo, *a, **kw)
            finally:
                self.store_rollback.append(time.perf_counter() - t0)

        Checkpoints.rollback = timed_store_rollback  # type: ignore[method-assign]

    def time_vm_steps(self) -> None:
        """Micro-VM: how long each checkpoint holds the guest paused, and how long the guest a rollback restores
        takes to answer its first call (TCG translating a guest whose code caches start cold: what bounds it)."""
        from moorage.sandbox.microvm import MicroVMSandbox

        self.vm_pause: list[float] = []
        self.vm_first_reply: list[float] = []
        self.vm_behind: list[float] = []
        snapshot_to, rollback = MicroVMSandbox._snapshot_to, MicroVMSandbox.rollback
        write_behind = MicroVMSandbox._write_behind

        async def timed_write_behind(sb: MicroVMSandbox, *a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await write_behind(sb, *a, **kw)
            finally:
                self.vm_behind.append(time.perf_counter() - t0)

        MicroVMSandbox._write_behind = timed_write_behind  # type: ignore[method-assign]

        async def timed_snapshot_to(sb: MicroVMSandbox, *a: Any, **kw: Any) -> Any:
            r = await snapshot_to(sb, *a, **kw)
            if kw.get("disk_tag"):
                ph = sb.last_snapshot_phases
                self.vm_pause.append((ph.get("pause_and_device_state", 0) + ph.get("ram_capture", 0)) / 1e3)
            return r

        async def timed_rollback(sb: MicroVMSandbox, *a: Any, **kw: Any) -> Any:
            r = await rollback(sb, *a, **kw)
            self.vm_first_reply.append(sb.last_wake_phases.get("first_reply", 0) / 1e3)
            return r

        MicroVMSandbox._snapshot_to = timed_snapshot_to  # type: ignore[method-assign]
        MicroVMSandbox.rollback = timed_rollback  # type: ignore[method-assign]


async def measure(driver_name: str, turns: int, rollbacks: int, forks: int, tmp: Path, images: Path) -> dict[str, Any]:
    cfg = Config(data_dir=tmp / "data", sandbox_driver=driver_name)
    store = open_store(cfg)
    principal = store.authenticate(store.operator.create_tenant("bench")[1].secret)
    if driver_name == "microvm":
        from moorage.sandbox.microvm import MicroVMDriver

        driver: Any = MicroVMDriver(cfg.sandboxes_dir, cfg, images_dir=images)
    else:
        driver = get_driver(cfg)
    manager = InstanceManager(store, driver)
    await manager.start()
    rt = Runtime(cfg, store, driver, gateway_from_config(cfg), manager)
    try:
        timed = Timed(rt)
        if driver_name == "microvm":
            timed.time_vm_steps()
        src = tmp / "agent"
        src.mkdir()
        (src / "moorage.toml").write_text('[agent]\nname = "tt"\nentry = "agent.py"\n[agent.timetravel]\nauto = true\n'
                                          f'keep = {turns + 10}\n[agent.lifecycle]\nusers = "auto"\n')
        (src / "agent.py").write_text(AGENT_PY)
        await rt.deploy(principal, src)
        who = EntityKey("tt", "ada")
        turn_s = []
        for i in range(1, turns + 1):
            t0 = time.perf_counter()
            await rt.invoke(principal, who, f"turn {i}")
            turn_s.append(time.perf_counter() - t0)
        ts = store.tenant(principal)
        cks = Checkpoints(ts).list("tt", "ada", limit=turns + 10)
        target = next(c for c in cks if c.summary.get("turn", {}).get("message") == f"turn {max(1, turns - 5)}")
        rb = []
        for _ in range(rollbacks):
            t0 = time.perf_counter()
            await rt.timetravel.rollback(principal, "tt", "ada", target.id)
            rb.append(time.perf_counter() - t0)
        rollback_ck = timed.whole[turns:]  # the before-rollback checkpoints
        t0 = time.perf_counter()
        await rt.timetravel.fork(principal, "tt", "ada", target.id, [f"fork{i}" for i in range(forks)])
        fork_s = time.perf_counter() - t0
        sandbox = await driver.open(cks[0].sandbox_id)
        listed = [c for c in await sandbox.checkpoints() if c.name.startswith("tt-")]
        vm_sizes = sorted(c.bytes for c in listed)
        # Micro-VM: the whole RAM delta each checkpoint stands for (it stores the pages changed since the last).
        whole_ram = sorted(json.loads((c.path / "snapshot.json").read_text()).get("ram_bytes", 0) for c in listed
                           if (c.path / "snapshot.json").exists())
        store_sizes = sorted(c.store_bytes for c in cks if c.kind == "turn")
        return {
            "driver": driver_name, "turns": turns,
            "turn": latency_summary(turn_s),
            "checkpoint": latency_summary(timed.whole[:turns]),
            "checkpoint_store_half": latency_summary(timed.store[:turns]),
            "rollback": latency_summary(rb),
            "rollback_parts": {"before_rollback_checkpoint": latency_summary(rollback_ck),
                               "sandbox_rollback": latency_summary(timed.vm_rollback),
                               "store_rollback": latency_summary(timed.store_rollback)},
            "fork_per_user_ms": fork_s * 1e3 / forks,
            "store_bytes_per_checkpoint_p50": store_sizes[len(store_sizes) // 2],
            "sandbox_bytes_per_checkpoint_p50": vm_sizes[len(vm_sizes) // 2] if vm_sizes else None,
            "whole_ram_delta_per_checkpoint_p50": whole_ram[len(whole_ram) // 2] if any(whole_ram) else None,
            **({"vm_pause_per_checkpoint": latency_summary(timed.vm_pause[:turns]),
                "vm_written_behind": latency_summary(timed.vm_behind[:turns]),
                "vm_first_reply_after_rollback": latency_summary(timed.vm_first_reply)} if driver_name == "microvm" else {}),
        }
    finally:
        await manager.close()
        for sid in await driver.list():
            sb = await driver.open(sid)
            await sb.destroy()
        await driver.close()
        store.close()


def http_phase(driver_name: str, turns: int, tmp: Path, images: Path, rollbacks: int) -> dict[str, Any]:
    """Turns through a real ``moorage up`` over HTTP, automatic checkpoints on vs off (see the docstring), then
    ``rollbacks`` rollbacks of the user's whole instance, each followed by a turn."""
    env = {"MOORAGE_TEST_IMAGES_DIR": str(images)} if driver_name == "microvm" else {}
    host = LocalHost("tt", tmp / "host", env, driver=driver_name)
    try:
        c = host.client(host.key)
        for name, auto in (("ckon", "true"), ("ckoff", "false")):
            d = tmp / f"src-{name}"
            d.mkdir()
            (d / "moorage.toml").write_text(f'[agent]\nname = "{name}"\nentry = "agent.py"\n[agent.timetravel]\n'
                                            f'auto = {auto}\n[agent.lifecycle]\nusers = "auto"\nsleep = "fixed:3600"\n')
            (d / "agent.py").write_text(AGENT_PY)
            r = c.post(f"/v1/agents/{name}/deployments", content=tar_dir(d), headers={"Content-Type": "application/gzip"})
            assert r.status_code == 201, r.text
        reply: dict[str, list[float]] = {"ckon": [], "ckoff": []}
        listing: dict[str, list[float]] = {"ckon": [], "ckoff": []}
        inside: dict[str, list[float]] = {"ckon": [], "ckoff": []}  # the host's own "turn" span of each turn

        def turn(agent: str, i: int) -> None:
            t0 = time.perf_counter()
            r = c.post(f"/v1/agents/{agent}/invoke", json={"message": f"turn {i}", "user": "ada"})
            t1 = time.perf_counter()
            assert r.status_code == 200 and r.json().get("reply") == f"done {i}", r.text
            lr = c.get(f"/v1/agents/{agent}/users/ada/checkpoints")  # waits for a checkpoint still being taken
            t2 = time.perf_counter()
            assert lr.status_code == 200, lr.text
            if i > 2:  # the first turns provision and warm the instance
                reply[agent].append(t1 - t0)
                listing[agent].append(t2 - t1)
                spans = c.get(f"/v1/traces/{r.json()['trace_id']}").json().get("spans", [])
                inside[agent] += [s["end_ts"] - s["start_ts"] for s in spans if s["name"] == "turn" and s.get("end_ts")]

        for i in range(1, turns + 1):
            for agent in (("ckon", "ckoff") if i % 2 else ("ckoff", "ckon")):
                turn(agent, i)
        # The user's rollback through HTTP, and the turn right after it (what a product waits for): each time back
        # to the checkpoint of the fifth turn from the end (the default retention keeps the last 20), or the oldest.
        back: list[float] = []
        after: list[float] = []
        listed = c.get("/v1/agents/ckon/users/ada/checkpoints", params={"limit": 500}).json()["data"]
        turned = [ck["id"] for ck in listed if ck["kind"] == "turn" and ck["restorable"] is not False]
        target = turned[min(4, len(turned) - 1)]
        for _ in range(rollbacks):
            t0 = time.perf_counter()
            r = c.post(f"/v1/agents/ckon/users/ada/checkpoints/{target}/rollback", json={})
            t1 = time.perf_counter()
            assert r.status_code == 200, r.text
            r = c.post("/v1/agents/ckon/invoke", json={"message": f"turn {turns + 1}", "user": "ada"})
            t2 = time.perf_counter()
            assert r.status_code == 200 and r.json().get("reply") == f"done {turns + 1}", r.text
            back.append(t1 - t0)
            after.append(t2 - t1)
        final = c.get("/v1/agents/ckon/users/ada/checkpoints").json()
        # What the user's instance holds on disk (disk, snapshot and checkpoints: the fleet view's figure), with
        # the default retention (keep 20) pruning: the per-user cost of automatic checkpoints.
        disk = {agent: sum(i["disk_bytes"] or 0 for i in c.get("/v1/fleet", params={"agent": agent}).json()["instances"]
                           if i["user"] == "ada") for agent in ("ckon", "ckoff")}
        took = sorted(ck["summary"].get("sandbox_ms", 0.0) for ck in final["data"] if ck["kind"] == "turn")
        missing = sum(1 for ck in final["data"] if ck["kind"] == "missing")
        on, off = latency_summary(reply["ckon"]), latency_summary(reply["ckoff"])
        lon, loff = latency_summary(listing["ckon"]), latency_summary(listing["ckoff"])
        return {"turn_auto_on": on, "turn_auto_off": off, "reply_path_added_p50_ms": on["p50_ms"] - off["p50_ms"],
                "turn_span_on": latency_summary(inside["ckon"]), "turn_span_off": latency_summary(inside["ckoff"]),
                "listing_after_reply_on": lon, "listing_after_reply_off": loff,
                "checkpoint_done_after_reply_p50_ms": lon["p50_ms"] - loff["p50_ms"],
                "checkpoint_sandbox_ms_p50": took[len(took) // 2] if took else None,
                "checkpoints": len(final["data"]), "missing": missing,
                "disk_bytes_per_user_on": disk["ckon"], "disk_bytes_per_user_off": disk["ckoff"],
                "rollback": latency_summary(back), "turn_after_rollback": latency_summary(after)}
    except httpx.HTTPError as e:
        raise RuntimeError(f"the host failed: {e}; its log: {host.log}") from e
    finally:
        host.stop()


def report(r: dict[str, Any]) -> str:
    f = lambda s: f"{s['p50_ms']:.1f} ms (p99 {s['p99_ms']:.1f}, n={s['n']})"  # noqa: E731
    sb = r["sandbox_bytes_per_checkpoint_p50"]
    h = r["http"]
    lines = [
        f"# Time travel ({r['driver']} driver, {platform.node()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
        "",
        "| what | measured | issue's target |",
        "|---|---|---|",
        f"| HTTP turn (`moorage up`), automatic checkpoints on, p50 | {f(h['turn_auto_on'])} | |",
        f"| HTTP turn, automatic checkpoints off, p50 | {f(h['turn_auto_off'])} | |",
        f"| **added to the reply path**, p50 difference | {h['reply_path_added_p50_ms']:.1f} ms | ≤ 5 ms |",
        f"| the host's own turn span, on vs off, p50 | {h['turn_span_on']['p50_ms']:.1f} vs {h['turn_span_off']['p50_ms']:.1f} ms | |",
        f"| checkpoint done after the reply (listing's extra wait), p50 | {h['checkpoint_done_after_reply_p50_ms']:.1f} ms | |",
        f"| its sandbox half (the host's record, `summary.sandbox_ms`), p50 | {h['checkpoint_sandbox_ms_p50']} ms | |",
        f"| checkpoints missing (failed) | {h['missing']} of {h['checkpoints']} | 0 |",
        f"| the user's disk after {r['turns']} turns (disk, snapshot, checkpoints; default retention), on vs off | "
        f"{h['disk_bytes_per_user_on'] / 2**20:.1f} vs {h['disk_bytes_per_user_off'] / 2**20:.1f} MiB | |",
        f"| in process: turn with its automatic checkpoint, p50 | {f(r['turn'])} | |",
        f"| in process: the checkpoint's own duration (the instance held; micro-VM: until the guest runs again), p50 "
        f"| {f(r['checkpoint'])} | |",
        f"| of which the store half, p50 | {f(r['checkpoint_store_half'])} | |",
        f"| rollback of the whole instance through HTTP (`moorage up`), p50 | {f(h['rollback'])} | ≤ 100 ms |",
        f"| the turn right after it, through HTTP, p50 | {f(h['turn_after_rollback'])} | |",
        f"| in process: rollback of the whole instance, p50 | {f(r['rollback'])} | ≤ 100 ms |",
        f"| of which its before-rollback checkpoint, p50 | {f(r['rollback_parts']['before_rollback_checkpoint'])} | |",
        f"| of which the sandbox's rollback, p50 | {f(r['rollback_parts']['sandbox_rollback'])} | |",
        f"| of which the store's rollback, p50 | {f(r['rollback_parts']['store_rollback'])} | |",
        *([f"| micro-VM: the guest paused per checkpoint, p50 | {f(r['vm_pause_per_checkpoint'])} | |",
           f"| micro-VM: its pages compressed and files written behind it (the next turn may run meanwhile), p50 | "
           f"{f(r['vm_written_behind'])} | |",
           f"| micro-VM: the restored guest's first reply in the sandbox's rollback, p50 (TCG translating a cold guest: "
           f"the bound) | {f(r['vm_first_reply_after_rollback'])} | |"] if "vm_pause_per_checkpoint" in r else []),
        f"| fork per new user | {r['fork_per_user_ms']:.0f} ms | |",
        f"| store bytes per turn checkpoint, p50 | {r['store_bytes_per_checkpoint_p50']} | |",
        f"| sandbox bytes per checkpoint, p50 | {sb if sb is not None else 'n/a'} | |",
        *([f"| the whole RAM delta each stands for (micro-VM: stored are the pages changed since the last), p50 | "
           f"{r['whole_ram_delta_per_checkpoint_p50']} | |"] if r.get("whole_ram_delta_per_checkpoint_p50") else []),
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--driver", default="process", choices=("process", "microvm"))
    ap.add_argument("--turns", type=int, default=30)
    ap.add_argument("--images", type=Path, default=Config().images_dir)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--http-only", action="store_true", help="only the reply-path phase; prints it, writes no report")
    a = ap.parse_args()
    turns, rollbacks, forks = (8, 2, 2) if a.quick else (a.turns, 5, 3)
    if a.http_only:
        with tempfile.TemporaryDirectory(prefix="moorage-bench-tt-") as d:
            h = http_phase(a.driver, turns, Path(d), a.images, rollbacks)
        print(json.dumps(h, indent=1))
        print(f"time travel ({a.driver}, HTTP only): reply path {h['reply_path_added_p50_ms']:+.1f} ms p50 "
              f"({h['turn_auto_on']['p50_ms']:.1f} vs {h['turn_auto_off']['p50_ms']:.1f} ms), checkpoint done "
              f"{h['checkpoint_done_after_reply_p50_ms']:.0f} ms after the reply")
        return
    with tempfile.TemporaryDirectory(prefix="moorage-bench-tt-") as d:
        r = asyncio.run(measure(a.driver, turns, rollbacks, forks, Path(d), a.images))
        r["http"] = http_phase(a.driver, turns, Path(d), a.images, rollbacks)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"timetravel-{a.driver}.json").write_text(json.dumps(r, indent=1))
    (OUT / f"timetravel-{a.driver}.md").write_text(report(r))
    print(report(r))
    h = r["http"]
    print(f"time travel ({a.driver}): reply path {h['reply_path_added_p50_ms']:+.1f} ms p50 (HTTP, "
          f"{h['turn_auto_on']['p50_ms']:.1f} vs {h['turn_auto_off']['p50_ms']:.1f} ms), checkpoint itself p50 "
          f"{r['checkpoint']['p50_ms']:.1f} ms (store half {r['checkpoint_store_half']['p50_ms']:.1f} ms; done "
          f"{h['checkpoint_done_after_reply_p50_ms']:.0f} ms after the reply), rollback p50 "
          f"{h['rollback']['p50_ms']:.0f} ms through HTTP ({r['rollback']['p50_ms']:.0f} ms in process), fork "
          f"{r['fork_per_user_ms']:.0f} ms per user")


if __name__ == "__main__":
    main()
