"""Attack benchmark: what a hostile guest does to a neighbour, measured beside it.

One host (in-process runtime, SQLite), two tenants: ``attacker`` runs the attack suite's hostile agent
(tests/attacks/hostile_agent.py), ``neighbour`` runs an echo agent, awake. The neighbour's turn latency is
sampled quiet first, then while each attack runs (the attack repeats until the neighbour has its samples).
An attack counts as contained when it ended the way the suite expects (an answer, or a clean moorage error),
the host's RSS grew less than the attack's bound, and the attacker answers a turn afterwards.

Then the same through ``moorage up`` and HTTP (``http_phase.py``): two tenants of a real host, the official client,
the attacks a turn starts; its line is printed just before the headline.

Writes bench/results/latest/attacks-<driver>.{md,json}; the last line printed is the headline (the in-process run):
``attacks N contained of N; neighbour p99 X ms quiet, worst X ms under attack (ATTACK)``.

    .venv/bin/python bench/attacks/run.py [--driver process|microvm] [--samples 60] [--quick] [--no-http] [--images DIR]

``--images``: where the micro-VM guest image is built or found (default: the default data directory's, the one
``moorage up`` built), so a run does not build one of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "store"))

from report import section  # noqa: E402  (bench/store/report.py: the report pieces the areas share)

sys.path.insert(0, str(ROOT / "bench" / "attacks"))
from http_phase import chosen, http_line, http_section, run_http_phase  # noqa: E402

from moorage import __version__  # noqa: E402
from moorage.config import Config  # noqa: E402
from moorage.errors import MoorageError  # noqa: E402
from moorage.lifecycle.manager import InstanceManager  # noqa: E402
from moorage.llm import gateway_from_config  # noqa: E402
from moorage.runtime.runtime import Runtime  # noqa: E402
from moorage.sandbox import get_driver  # noqa: E402
from moorage.sandbox.base import GuestFileTooLarge  # noqa: E402
from moorage.store import EntityKey, Scope, open_store  # noqa: E402
from tests.attacks.hostile_agent import AGENT as HOSTILE  # noqa: E402

OUT = ROOT / "bench" / "results" / "latest"
MiB = 1 << 20
ECHO = "async def on_message(ctx, message):\n    return message\n"


def agent_dir(base: Path, name: str, code: str) -> Path:
    """An agent with automatic checkpoints off: what is measured is an attack's effect on the neighbour, not the
    neighbour's own checkpoint after each of its back-to-back turns (bench/timetravel measures that)."""
    d = base / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "moorage.toml").write_text(f'[agent]\nname = "{name}"\nentry = "agent.py"\n[agent.timetravel]\nauto = false\n'
                                    '[agent.lifecycle]\nusers = "auto"\n')
    (d / "agent.py").write_text(code)
    return d


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def tree_cpu_s(pid: int | None) -> float:
    """CPU seconds of a process tree: each live process's own time, plus what its reaped children used."""
    if not pid:
        return 0.0
    from moorage.sandbox.process_limits import descendants

    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for i, p in enumerate([pid, *descendants(pid)]):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # utime stime cutime cstime are fields 14-17 of stat (11-14 after the command name)
        total += sum(int(x) for x in fields[11:15])
    return total / tick


#: The neighbour takes at most this many times ``--samples`` turns during one attack.
MAX_TURNS_PER_SAMPLE = 5


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))] if s else float("nan")


@dataclass
class Attack:
    name: str
    bound_mib: int
    run: Callable[["Bench"], Awaitable[str]]  # returns how it ended ("answer ..." / "refused ...")
    drivers: tuple[str, ...] = ("process", "microvm")


class Bench:
    def __init__(self, rt: Runtime, attacker: Any, neighbour: Any) -> None:
        self.rt = rt
        self.attacker = attacker
        self.neighbour = neighbour
        self.mallory = EntityKey("hostile", "mallory")
        self.echo = EntityKey("echo", "nina")

    async def say(self, msg: str) -> str:
        return str((await self.rt.invoke(self.attacker, self.mallory, msg)).reply)

    async def clean_up(self) -> None:
        """Between attacks: the attacker's disk emptied. An attack that ended with its sandbox stopped (a filled
        disk, a broken protocol) may still be stopping when this turn starts, which then fails cleanly: retried."""
        for attempt in range(3):
            try:
                await self.say("clean-disk")
                return
            except MoorageError:
                if attempt == 2:
                    raise
                await asyncio.sleep(0.5)

    async def neighbour_turn(self) -> float:
        t = time.perf_counter()
        r = await self.rt.invoke(self.neighbour, self.echo, "hello")
        assert r.reply == "hello", r.reply
        return time.perf_counter() - t

    async def attacker_pid(self) -> int | None:
        sb = await self.attacker_sandbox()
        return getattr(sb, "pid", None) or getattr(sb, "_pid", None)

    async def attacker_sandbox(self) -> Any:
        ts = self.rt.store.tenant(self.attacker)
        rec = ts.sandboxes.for_scope(Scope.for_user("hostile", "mallory"))
        return await self.rt.driver.open(rec.id)


async def expect_error(coro: Awaitable[Any]) -> str:
    try:
        await coro
    except MoorageError as e:
        return f"refused: {type(e).__name__}"
    return "answered (not refused)"


async def endless_read(b: Bench) -> str:
    await b.say("endless-read")
    sb = await b.attacker_sandbox()
    try:
        await sb.read_file("/work/x")
    except GuestFileTooLarge:
        return "refused: GuestFileTooLarge"
    return "read to the end (not cut off)"


ATTACKS = [
    Attack("request flood (20k)", 32, lambda b: b.say("flood 20000")),
    Attack("nested frames (200k deep)", 32, lambda b: b.say("deep 200000")),
    Attack("event flood (80 MB)", 64, lambda b: b.say("events 20000")),
    Attack("endless file read", 3 * 64, endless_read),
    Attack("console flood", 32, lambda b: b.say("console 4000000")),
    Attack("huge frame (4 GiB)", 32, lambda b: expect_error(b.say("huge"))),
    Attack("user namespaces", 32, lambda b: b.say("userns"), ("process",)),
    Attack("raw sockets", 32, lambda b: b.say("raw-socket"), ("process",)),
    Attack("disk fill by the supervisor", 64, lambda b: expect_error(b.say("fill-disk")), ("process",)),
]

EXPECTED = {
    "request flood (20k)": lambda out: out == "flooded 20000",
    "nested frames (200k deep)": lambda out: out == "survived",
    "event flood (80 MB)": lambda out: out == "emitted 20000",
    "endless file read": lambda out: out.startswith("refused"),
    "console flood": lambda out: out.startswith("wrote"),
    "huge frame (4 GiB)": lambda out: out.startswith("refused"),
    "user namespaces": lambda out: json.loads(out) == {"user": "EPERM", "net": "EPERM", "mount": "EPERM"},
    "raw sockets": lambda out: json.loads(out)["raw-icmp"] == "EPERM",
    "disk fill by the supervisor": lambda out: out.startswith("refused"),
}


async def sample_neighbour(b: Bench, n: int) -> list[float]:
    return [await b.neighbour_turn() for _ in range(n)]


async def under_attack(b: Bench, attack: Attack, samples: int) -> dict[str, Any]:
    lat: list[float] = []
    outcomes: list[str] = []
    queue = getattr(b.rt, "embed_queue", None)  # earlier turns' background embedding is not this attack's
    if queue is not None:
        await asyncio.to_thread(queue.wait_idle, 60)
    # Quiet turns right before the attack: on a machine shared with other work the load moves within a run, and
    # the ratio to the quiet turns next to it says what the attack did, not what the neighbours of the host did.
    before = await sample_neighbour(b, max(10, samples // 2))
    if queue is not None:
        await asyncio.to_thread(queue.wait_idle, 60)
    start = rss()
    peak = start
    stop = asyncio.Event()
    lags: list[float] = []

    async def watch() -> None:
        # Also the host event loop's lag: how late a 5 ms sleep wakes up says whether the loop is the bottleneck.
        nonlocal peak
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            peak = max(peak, rss())
            t = loop.time()
            await asyncio.sleep(0.005)
            lags.append(loop.time() - t - 0.005)

    async def attacker() -> None:
        while not stop.is_set():
            try:
                outcomes.append(await attack.run(b))
            except Exception as e:  # an unexpected failure is recorded as not contained, never hidden
                outcomes.append(f"unexpected {type(e).__name__}: {e}")
            if len(lat) >= samples:
                return

    apid = await b.attacker_pid()
    cpu0, acpu0 = time.process_time(), tree_cpu_s(apid)
    watcher = asyncio.create_task(watch())
    attacking = asyncio.create_task(attacker())
    t0 = time.perf_counter()
    while (len(lat) < samples or not outcomes) and len(lat) < MAX_TURNS_PER_SAMPLE * samples:
        lat.append(await b.neighbour_turn())
        if time.perf_counter() - t0 > 600:
            break
    # A long attack (a flood held to its tenant's CPU share lasts minutes) is sampled for its first turns only: the
    # neighbour's own history grows with every turn, and with it the host's memory and the neighbour's latency.
    await attacking
    wall = time.perf_counter() - t0
    host_cpu = time.process_time() - cpu0
    # The attacker's tree as it stands now (a guest stopped by the attack restarts with a new tree: then unknown).
    acpu = tree_cpu_s(apid) - acpu0 if apid == await b.attacker_pid() else float("nan")
    if acpu < 0:  # processes killed mid-attack (the quota watchdog) and reaped outside the tree: not known
        acpu = float("nan")
    stop.set()
    await watcher
    try:
        after = await b.say("ping")
    except Exception as e:
        after = f"{type(e).__name__}: {e}"
    ok = all(EXPECTED[attack.name](o) for o in outcomes)
    growth = (peak - start) / MiB
    contained = ok and growth < attack.bound_mib and after == "pong"
    return {"attack": attack.name, "runs": len(outcomes), "outcomes": sorted(set(outcomes)), "rss_growth_mib": growth,
            "bound_mib": attack.bound_mib, "attacker_after": after, "contained": contained,
            "neighbour_p50_ms": pct(lat, 0.5) * 1e3, "neighbour_p99_ms": pct(lat, 0.99) * 1e3, "n": len(lat),
            "quiet_before_p99_ms": pct(before, 0.99) * 1e3, "quiet_before_n": len(before),
            "wall_s": wall, "host_cpu_pct": 100 * host_cpu / wall, "attacker_cpu_pct": 100 * acpu / wall,
            "loop_lag_p99_ms": pct(lags, 0.99) * 1e3}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="moorage-bench-attacks-"))
    cfg = Config(data_dir=work / "data", sandbox_driver=args.driver, log_level="error")
    store = open_store(cfg)
    _, akey = store.operator.create_tenant("attacker")
    _, nkey = store.operator.create_tenant("neighbour")
    attacker, neighbour = store.authenticate(akey.secret), store.authenticate(nkey.secret)
    if args.driver == "microvm":
        from moorage.sandbox.microvm import MicroVMDriver

        driver: Any = MicroVMDriver(cfg.sandboxes_dir, cfg, images_dir=args.images)
    else:
        driver = get_driver(cfg)
    manager = InstanceManager(store, driver)
    await manager.start()
    rt = Runtime(cfg, store, driver, gateway_from_config(cfg), manager)
    res: dict[str, Any] = {"driver": args.driver, "host": platform.node(), "python": platform.python_version(),
                           "moorage": __version__, "samples": args.samples}
    try:
        await rt.deploy(attacker, agent_dir(work, "hostile", HOSTILE))
        await rt.deploy(neighbour, agent_dir(work, "echo", ECHO))
        b = Bench(rt, attacker, neighbour)
        assert await b.say("ping") == "pong"
        await sample_neighbour(b, 20)  # warm: models load, caches fill, the neighbour is awake
        # Each attack once before measuring (first uses start threads and connections that stay).
        chosen = [a for a in ATTACKS if args.driver in a.drivers and (not args.only or any(
            o.lower() in a.name.lower() for o in args.only))]
        for a in chosen:
            await a.run(b)
            await b.clean_up()
        quiet = await sample_neighbour(b, args.samples * 2)
        res["quiet"] = {"p50_ms": pct(quiet, 0.5) * 1e3, "p99_ms": pct(quiet, 0.99) * 1e3, "n": len(quiet)}
        print(f"quiet: neighbour p50 {res['quiet']['p50_ms']:.1f} ms p99 {res['quiet']['p99_ms']:.1f} ms", flush=True)
        res["attacks"] = []
        for a in chosen:
            r = await under_attack(b, a, args.samples)
            await b.clean_up()
            res["attacks"].append(r)
            print(f"{a.name}: {'contained' if r['contained'] else 'NOT CONTAINED'}; neighbour p99 "
                  f"{r['neighbour_p99_ms']:.1f} ms (quiet just before {r['quiet_before_p99_ms']:.1f} ms); host RSS +{r['rss_growth_mib']:.1f} MiB (bound {a.bound_mib}); "
                  f"host CPU {r['host_cpu_pct']:.0f}%, attacker CPU {r['attacker_cpu_pct']:.0f}%, loop lag p99 "
                  f"{r['loop_lag_p99_ms']:.1f} ms; {r['runs']} runs: {', '.join(r['outcomes'])[:160]}", flush=True)
    finally:
        await manager.close()
        for sid in await driver.list():
            try:
                sb = await driver.open(sid)
                await sb.destroy()
            except Exception as e:  # a benchmark cleans up what it can and says so
                print("cleanup failed", sid, e, file=sys.stderr)
        await driver.close()
        store.close()
        shutil.rmtree(work, ignore_errors=True)
    return res


def bound_note(attacks: list[dict[str, Any]]) -> list[str]:
    """What bounded the neighbour, from the CPU figures of the same run."""
    host = [r["host_cpu_pct"] for r in attacks]
    att = [r["attacker_cpu_pct"] for r in attacks if r["attacker_cpu_pct"] == r["attacker_cpu_pct"]]
    if not host or not att:
        return []
    where = ("the host process (its one event loop and GIL: decoding the attacker's frames, serving its calls, "
             "committing its turns), not the attacker's own CPU" if min(host) > max(att) else
             "partly the attacking sandbox's CPU (see the attacker column) and partly the host process")
    return [f"What bounds the neighbour here: during the attacks the host process used {min(host):.0f}-{max(host):.0f}% "
            f"of a core and the attacking sandbox {min(att):.0f}-{max(att):.0f}%, so it is {where}. The sandbox's "
            "CPU share (cgroups) cannot move this; what the host spends per attacker frame and per attacker turn can."]


def write_report(res: dict[str, Any]) -> str:
    attacks = res["attacks"]
    worst = max(attacks, key=lambda r: r["neighbour_p99_ms"])
    n_ok = sum(r["contained"] for r in attacks)
    head = (f"attacks {n_ok} contained of {len(attacks)}; neighbour p99 {res['quiet']['p99_ms']:.0f} ms quiet, "
            f"worst {worst['neighbour_p99_ms']:.0f} ms under attack ({worst['attack']})")
    res["headline"] = head
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"attacks-{res['driver']}.json").write_text(json.dumps(res, indent=2))
    md = ["# Attack benchmark", "",
          f"Driver **{res['driver']}**, host `{res['host']}`, Python {res['python']}, moorage {res['moorage']}. "
          "Shared 2-core machine: read the ratio to the quiet p99 in the same run, not single numbers.",
          *section("Neighbour turns under each attack",
                   f"The neighbour (another tenant's echo agent, awake; both agents with automatic checkpoints off) "
                   f"takes {res['samples']} turns one after another "
                   f"while the attack repeats (a longer attack: its first {MAX_TURNS_PER_SAMPLE * res['samples']} turns, "
                   f"then the attack is waited for); quiet: p50 {res['quiet']['p50_ms']:.1f} ms, p99 "
                   f"{res['quiet']['p99_ms']:.1f} ms ({res['quiet']['n']} turns). Before each attack it also takes "
                   f"{max(10, res['samples'] // 2)} quiet turns: the ratio to those is the one to read when other work "
                   "shares the machine. Host CPU is this process (event loop and executor threads), attacker CPU "
                   "the attacking sandbox's processes, both in % of one core; the loop lag is how late a 5 ms sleep "
                   "of the host's event loop wakes.",
                   ["attack", "contained", "neighbour p50 ms", "neighbour p99 ms", "p99 / quiet",
                    "quiet p99 just before ms", "p99 / just before", "host RSS +MiB (bound)",
                    "host CPU %", "attacker CPU %", "host loop lag p99 ms", "attack runs", "outcome"])]
    for r in attacks:
        md.append(f"| {r['attack']} | {'yes' if r['contained'] else '**no**'} | {r['neighbour_p50_ms']:.1f} | "
                  f"{r['neighbour_p99_ms']:.1f} | {r['neighbour_p99_ms'] / res['quiet']['p99_ms']:.1f}x | "
                  f"{r['quiet_before_p99_ms']:.1f} | {r['neighbour_p99_ms'] / r['quiet_before_p99_ms']:.1f}x | "
                  f"{r['rss_growth_mib']:.1f} ({r['bound_mib']}) | {r['host_cpu_pct']:.0f} | {r['attacker_cpu_pct']:.0f} | "
                  f"{r['loop_lag_p99_ms']:.1f} | {r['runs']} | {'; '.join(r['outcomes'])[:120]} |")
    by_ratio = max(attacks, key=lambda r: r["neighbour_p99_ms"] / r["quiet_before_p99_ms"])
    res["worst_ratio"] = {"attack": by_ratio["attack"],
                          "ratio": by_ratio["neighbour_p99_ms"] / by_ratio["quiet_before_p99_ms"]}
    md += ["", f"Worst p99 against the quiet turns just before it: {res['worst_ratio']['ratio']:.1f}x "
           f"({by_ratio['attack']}); target 3x.", "", *bound_note(attacks)]
    if res.get("http"):
        md += http_section(res["http"])
    md += ["", f"**{head}**", ""]
    (OUT / f"attacks-{res['driver']}.md").write_text("\n".join(md))
    return head


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--driver", choices=["process", "microvm"], default="process")
    ap.add_argument("--samples", type=int, default=60)
    ap.add_argument("--quick", action="store_true", help="20 neighbour turns per attack")
    ap.add_argument("--only", action="append", default=[], metavar="NAME",
                    help="run only the attacks whose name contains NAME (repeatable)")
    ap.add_argument("--no-http", action="store_true", help="skip the phase through moorage up and HTTP")
    ap.add_argument("--images", type=Path, default=Config().images_dir,
                    help="where the micro-VM guest image is built or found")
    a = ap.parse_args()
    if a.quick:
        a.samples = 20
    result = asyncio.run(main(a))
    if not a.no_http and chosen(a.only):
        with tempfile.TemporaryDirectory(prefix="moorage-bench-attacks-http-") as d:
            srcs = {"hostile": agent_dir(Path(d), "hostile", HOSTILE), "echo": agent_dir(Path(d), "echo", ECHO)}
            result["http"] = run_http_phase(a.driver, Path(d), srcs, a.samples, MAX_TURNS_PER_SAMPLE,
                                            {"MOORAGE_TEST_IMAGES_DIR": str(a.images)} if a.driver == "microvm" else {},
                                            a.only)
    headline = write_report(result)
    print(f"worst p99 against the quiet turns just before it: {result['worst_ratio']['ratio']:.1f}x "
          f"({result['worst_ratio']['attack']})")
    if result.get("http"):
        print(http_line(result["http"]))
    print(headline)
