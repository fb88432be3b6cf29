"""Sandbox benchmark: cold boot, sleep, wake (to the first channel reply), fork per child, checkpoint, rollback,
disk per sleeping agent and host RSS per awake agent, for the micro-VM driver on this host.

Usage: python bench/sandbox/run.py [--reps 20] [--forks 6] [--cold 3]
Writes bench/results/latest/sandbox.{md,json}; the last printed line is the headline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from moorage.config import Config
from moorage.sandbox.microvm import MicroVMDriver
from moorage.sandbox.microvm_qemu import qemu_version

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def summary(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    p99 = s[min(len(s) - 1, max(0, round(0.99 * (len(s) - 1))))]
    return {"n": len(s), "p50": statistics.median(s), "p99": p99, "min": s[0], "max": s[-1]}


def ms(d: dict[str, float]) -> str:
    return f"p50 {d['p50'] * 1000:.0f} ms p99 {d['p99'] * 1000:.0f} ms (min {d['min'] * 1000:.0f}, max {d['max'] * 1000:.0f}, n={d['n']})"


def pss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


async def timed(coro) -> float:  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    await coro
    return time.perf_counter() - t


async def main(args: argparse.Namespace) -> dict:
    images = Path(os.environ.get("MOORAGE_IMAGES_DIR", "/var/tmp/moorage-images"))
    work = Path(tempfile.mkdtemp(prefix="moorage-bench-", dir="/var/tmp"))
    driver = MicroVMDriver(work / "sandboxes", Config(data_dir=work / "data"), images_dir=images)
    res: dict = {"host": platform.node(), "qemu": qemu_version(), "accel": driver.accel, "python": sys.version.split()[0]}
    try:
        # Baseline in the same run: cold boot of the same image to the first channel reply.
        cold = []
        for i in range(args.cold):
            sb = await driver.create(f"cold-{i}")
            cold.append(await timed(sb.start()))
            if i < args.cold - 1:
                await sb.destroy()
        base = sb
        res["cold_boot"] = summary(cold)
        print("cold boot", ms(res["cold_boot"]), flush=True)

        # Sleep/wake of a cold-booted sandbox (RAM in its own shared file).
        s_sleep, s_wake = [], []
        for _ in range(max(3, args.reps // 4)):
            s_sleep.append(await timed(base.sleep()))
            s_wake.append(await timed(base.wake()))
        res["own_ram_sleep"], res["own_ram_wake"] = summary(s_sleep), summary(s_wake)
        st = await base.stats()
        await base.sleep()
        res["own_ram_sleeping_bytes"] = (await base.stats()).snapshot_bytes
        await base.wake()
        print("own-RAM sandbox: sleep", ms(res["own_ram_sleep"]), "| wake", ms(res["own_ram_wake"]), flush=True)

        t = time.perf_counter()
        tpl = await driver.make_template(base, "bench-tpl")
        res["make_template_s"] = time.perf_counter() - t
        res["template_bytes"] = sum(p.stat().st_blocks * 512 for p in Path(tpl.path).rglob("*") if p.is_file())

        # Forks: create N children in one call, then wake each to its first channel reply.
        ids = [f"fork-{i}" for i in range(args.forks)]
        t = time.perf_counter()
        kids = await driver.fork(tpl, ids)
        create_s = time.perf_counter() - t
        per_child = []
        for k in kids:
            per_child.append(create_s / len(kids) + await timed(k.wake()))
        res["fork_per_child"] = summary(per_child)
        res["fork_create_all_s"] = create_s
        print("fork per child (create + first wake)", ms(res["fork_per_child"]), flush=True)

        # The same, as a batch: fork N more children and wake them all at once (QEMU start-up of one overlaps
        # another's guest on a multi-core host); wall time to the last first reply, per child.
        batch_ids = [f"batch-{i}" for i in range(args.forks)]
        t = time.perf_counter()
        batch = await driver.fork(tpl, batch_ids)
        await asyncio.gather(*(k.wake() for k in batch))
        res["fork_batch_per_child_s"] = (time.perf_counter() - t) / len(batch)
        res["fork_batch_n"] = len(batch)
        for k in batch:
            await k.destroy()
        print(f"fork batch of {len(batch)}: {res['fork_batch_per_child_s'] * 1000:.0f} ms per child", flush=True)

        # Host memory per awake agent.
        rss = [(await k.stats()).host_rss_bytes for k in kids]
        pss = [pss_bytes(k.pid) for k in kids if k.pid]
        res["rss_per_awake_fork_mib"] = statistics.median(rss) / MiB
        res["pss_per_awake_fork_mib"] = statistics.median(pss) / MiB
        res["rss_own_ram_mib"] = st.host_rss_bytes / MiB

        # Sleep / wake cycles on a fork (the normal path: agents are forked from a template).
        a = kids[0]
        await a.write_file("/work/agent-state.json", json.dumps({"turns": 1}).encode())
        f_sleep, f_wake, phases = [], [], {}
        for _ in range(args.reps):
            f_sleep.append(await timed(a.sleep()))
            f_wake.append(await timed(a.wake()))
            for name, v in a.last_wake_phases.items():
                phases.setdefault(name, []).append(v)
        res["sleep"], res["wake"] = summary(f_sleep), summary(f_wake)
        res["wake_phases_p50_ms"] = {name: statistics.median(v) for name, v in phases.items()}
        print("fork: sleep", ms(res["sleep"]), "| wake", ms(res["wake"]), flush=True)

        # Disk per sleeping agent beyond the template.
        beyond = []
        for k in kids:
            await k.sleep()
            s = await k.stats()
            beyond.append(s.snapshot_bytes + s.disk_bytes)
        res["disk_per_sleeping_agent_mib"] = summary([b / MiB for b in beyond])
        await a.wake()

        # Checkpoint and rollback at agent-step granularity.
        ck, rb = [], []
        for i in range(max(3, args.reps // 2)):
            await a.write_file("/work/step.txt", str(i).encode())
            ck.append(await timed(a.checkpoint("step")))
            await a.write_file("/work/step.txt", b"after")
            rb.append(await timed(a.rollback("step")))
        res["checkpoint"], res["rollback"] = summary(ck), summary(rb)
        print("checkpoint", ms(res["checkpoint"]), "| rollback", ms(res["rollback"]), flush=True)
    finally:
        for sid in await driver.list():
            try:
                await (await driver.open(sid)).destroy()
            except Exception as e:  # a benchmark cleans up what it can and says so
                print("cleanup failed", sid, e, file=sys.stderr)
        await driver.close()
        shutil.rmtree(work, ignore_errors=True)
    res["cold_over_wake"] = res["cold_boot"]["p50"] / res["wake"]["p50"]
    return res


def write_report(res: dict) -> str:
    head = (
        f"wake p50 {res['wake']['p50'] * 1000:.0f} ms p99 {res['wake']['p99'] * 1000:.0f} ms; "
        f"sleep p50 {res['sleep']['p50'] * 1000:.0f} ms p99 {res['sleep']['p99'] * 1000:.0f} ms; "
        f"fork {res['fork_per_child']['p50'] * 1000:.0f} ms/child ({res['fork_batch_per_child_s'] * 1000:.0f} in a batch of {res['fork_batch_n']}); "
        f"checkpoint p50 {res['checkpoint']['p50'] * 1000:.0f} ms; rollback p50 {res['rollback']['p50'] * 1000:.0f} ms; "
        f"cold/wake {res['cold_over_wake']:.0f}x; disk/sleeping agent {res['disk_per_sleeping_agent_mib']['p50']:.1f} MiB"
    )
    res["headline"] = head
    out = ROOT / "bench" / "results" / "latest"
    out.mkdir(parents=True, exist_ok=True)
    (out / "sandbox.json").write_text(json.dumps(res, indent=2))
    rows = [
        ("cold boot (baseline, to first channel reply)", res["cold_boot"]),
        ("sleep (fork, incl. guest sync, RAM delta, fsyncs)", res["sleep"]),
        ("wake (fork, to the first channel reply, which also sets the clock)", res["wake"]),
        ("fork per child (create + first wake)", res["fork_per_child"]),
        ("checkpoint", res["checkpoint"]),
        ("rollback (to first channel reply)", res["rollback"]),
        ("sleep, sandbox with its own RAM file", res["own_ram_sleep"]),
        ("wake, sandbox with its own RAM file", res["own_ram_wake"]),
    ]
    md = [
        "# Sandbox benchmark (microvm driver)",
        "",
        f"Host `{res['host']}`, {res['qemu']}, accelerator **{res['accel']}**, Python {res['python']}. "
        "Shared 2-core machine: read medians and ratios, not single numbers.",
        "",
        "| operation | p50 ms | p99 ms | min ms | max ms | n |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, d in rows:
        md.append(f"| {name} | {d['p50'] * 1000:.0f} | {d['p99'] * 1000:.0f} | {d['min'] * 1000:.0f} | {d['max'] * 1000:.0f} | {d['n']} |")
    dd = res["disk_per_sleeping_agent_mib"]
    md += [
        "",
        f"- disk per sleeping forked agent beyond the template (RAM delta + device state + disk overlay): p50 {dd['p50']:.1f} MiB, max {dd['max']:.1f} MiB",
        f"- disk of a sleeping sandbox with its own RAM file (not forked): {res['own_ram_sleeping_bytes'] / MiB:.0f} MiB",
        f"- template on disk: {res['template_bytes'] / MiB:.0f} MiB; making it took {res['make_template_s'] * 1000:.0f} ms",
        f"- host memory per awake forked agent: RSS {res['rss_per_awake_fork_mib']:.0f} MiB, PSS {res['pss_per_awake_fork_mib']:.0f} MiB (template pages shared); own-RAM sandbox RSS {res['rss_own_ram_mib']:.0f} MiB",
        f"- fork, a batch of {res['fork_batch_n']} forked and woken at once: {res['fork_batch_per_child_s'] * 1000:.0f} ms per child (wall time to the last first reply / n)",
        "- wake phases, p50 ms: " + ", ".join(f"{k} {v:.0f}" for k, v in res["wake_phases_p50_ms"].items()),
        f"- cold boot / wake: {res['cold_over_wake']:.0f}x",
        "",
        f"**{head}**",
        "",
    ]
    (out / "sandbox.md").write_text("\n".join(md))
    return head


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--forks", type=int, default=6)
    ap.add_argument("--cold", type=int, default=3)
    result = asyncio.run(main(ap.parse_args()))
    print(write_report(result))
