"""A VM's own network, measured where its bytes go: a client inside the sandbox fetching through ``HTTP_PROXY`` over
its NIC (a tap in the VM's own namespace, the egress gateway's proxy listening there, a loopback upstream on the host)
and through the channel relay (the guest relay, the host↔guest channel, the same proxy), against the same client
fetching from a server on the sandbox's own loopback (the direct fetch in the same sandbox) and from the host; and the
wake p50 of an instance whose agent has a network (a NIC where the host can make one) against one without, forked and
woken alike.

Usage: python bench/sandbox/vm_network.py [--driver microvm] [--reps 20] [--small 100] [--wakes 20]
Writes bench/results/latest/vm-network.{md,json}; the last printed line is the headline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
MiB = 1 << 20

#: The loopback upstream, on the host (``--serve PORT`` inside the guest: the same server on its loopback).
SERVER = textwrap.dedent('''
    import http.server, sys
    BIG = b"b" * (1 << 20)
    class H(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"
        def do_GET(self):
            body = BIG if self.path.endswith("/big") else b"ok"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *a):
            pass
    s = http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1]) if len(sys.argv) > 1 else 0), H)
    print(s.server_address[1], flush=True)
    s.serve_forever()
''')

#: The client, stdlib only (it runs in the guest too): timings of downloads and of rounds of small requests, as
#: JSON. ``urllib`` takes HTTP_PROXY from the environment unless the URL is on NO_PROXY (the guest's loopback).
CLIENT = textwrap.dedent('''
    import json, sys, time, urllib.request
    base, reps, small, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    opener = urllib.request.build_opener()
    def get(path):
        with opener.open(base + path, timeout=60) as r:
            return len(r.read())
    get("/big")
    big = []
    for _ in range(reps):
        t = time.perf_counter()
        assert get("/big") >= 1 << 20
        big.append(time.perf_counter() - t)
    totals = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(small):
            get("/small")
        totals.append(time.perf_counter() - t)
    print(json.dumps({"big": big, "small_total": totals}))
''')


def summary(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {"n": len(s), "p50": statistics.median(s), "p99": s[min(len(s) - 1, round(0.99 * (len(s) - 1)))],
            "min": s[0], "max": s[-1]}


def _driver(name: str, work: Path) -> Any:
    from moorage.config import Config

    cfg = Config(data_dir=work / "data", sandbox_driver=name)
    if name == "microvm":
        from moorage.sandbox.microvm import MicroVMDriver

        images = Path(os.environ.get("MOORAGE_IMAGES_DIR", "/var/tmp/moorage-images"))
        return MicroVMDriver(work / "sandboxes", cfg, images_dir=images)
    from moorage.sandbox.process import ProcessDriver

    return ProcessDriver(work / "sandboxes", cfg)


async def _client_in(sb: Any, base: str, args: argparse.Namespace, env: dict[str, str] | None = None) -> dict[str, Any]:
    r = await sb.exec(["python3", "-c", CLIENT, base, str(args.reps), str(args.small), str(args.rounds)], env=env,
                      timeout=1800)
    if r.exit_code != 0:
        raise RuntimeError(f"client in the sandbox failed: {r.stderr.decode(errors='replace')[-2000:]}")
    return json.loads(r.stdout)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    from moorage.egress import AddressPolicy, Egress, Limits, OperatorPolicy, StaticResolver
    from moorage.runtime.vm_network import PROXY_URL, attach_instance, guest_env
    from moorage.sandbox import SandboxSpec

    work = Path(tempfile.mkdtemp(prefix="moorage-bench-net-", dir="/var/tmp"))
    driver = _driver(args.driver, work)
    upstream = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE)
    assert upstream.stdout is not None
    port = int(upstream.stdout.readline())
    host_base = f"http://127.0.0.1:{port}"
    # Inside the sandbox 127.0.0.1 is its own loopback (and on NO_PROXY): the upstream gets a name, which the
    # gateway resolves to the host's loopback (allowed by this benchmark's operator policy).
    guest_base = f"http://upstream.bench:{port}"
    res: dict[str, Any] = {"host": platform.node(), "python": sys.version.split()[0], "cpus": os.cpu_count(),
                           "driver": args.driver, "accel": getattr(driver, "accel", None),
                           "loadavg_1m_at_start": os.getloadavg()[0], "reps": args.reps, "small": args.small,
                           "rounds": args.rounds, "wakes": args.wakes}
    eg = Egress(OperatorPolicy(AddressPolicy.of(False, "127.0.0.0/8"), limits=Limits(connects_per_s=100000)),
                StaticResolver({"upstream.bench": ["127.0.0.1"]}))
    manifest = {"network": {"allow": [f"http://upstream.bench:{port}"]}}
    try:
        # Two templates, the same but for the network's environment, as deploy makes them; one fork of each.
        kids = {}
        for label, env in (("network", guest_env(manifest)), ("none", {})):
            builder = await driver.create(f"tpl-{label}", SandboxSpec(env=env))
            await builder.start()
            ref = await driver.make_template(builder, f"bench-{label}")
            (kids[label],) = await driver.fork(ref, [f"kid-{label}"])
            kid = kids[label]
            await (kid.start() if kid.state.value == "created" else kid.wake())
        net = kids["network"]
        res["nic"] = bool(getattr(net, "_vm_config", lambda: None)() and net._vm_config().nic)

        # 1. Wake p50 first, while both forks are as their templates left them (the fetches below dirty the
        # network one's memory: a larger RAM delta to restore), interleaved so that drift in the load spreads over both.
        wakes: dict[str, list[float]] = {"network": [], "none": []}
        phases: dict[str, dict[str, list[float]]] = {"network": {}, "none": {}}
        for _ in range(args.wakes):
            for label, sb in kids.items():
                await sb.sleep()
                t = time.perf_counter()
                await sb.wake()
                wakes[label].append(time.perf_counter() - t)
                for name, v in (getattr(sb, "last_wake_phases", None) or {}).items():
                    phases[label].setdefault(name, []).append(v)
        res["wake"] = {label: summary(v) for label, v in wakes.items()}
        res["wake_phases_p50_ms"] = {label: {k: statistics.median(v) for k, v in ph.items()} for label, ph in phases.items()}
        print(f"wake p50: with a network {res['wake']['network']['p50'] * 1000:.0f} ms, without "
              f"{res['wake']['none']['p50'] * 1000:.0f} ms", flush=True)
        # 2. Fetches: the same client on the host, inside the sandbox from its own loopback, and through its proxy.
        start = ("import subprocess, sys; subprocess.Popen([sys.executable, '-c', sys.argv[1], '18080'], "
                 "start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)")
        srv = await net.exec(["python3", "-c", start, SERVER], timeout=30)
        assert srv.exit_code == 0, srv.stderr
        for _ in range(100):
            if (await net.exec(["python3", "-c", "import socket; socket.create_connection(('127.0.0.1', 18080), 1)"])).exit_code == 0:
                break
            await asyncio.sleep(0.1)
        attach_instance(net.channel, eg.instance(manifest, usage=eg.usage_for(net.id)), net.id)
        ways: dict[str, dict[str, Any]] = {}
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", CLIENT, host_base, str(args.reps),
                                                    str(args.small), str(args.rounds), stdout=asyncio.subprocess.PIPE)
        out, _ = await proc.communicate()
        ways["host, direct to the upstream"] = json.loads(out)
        ways["sandbox, direct to its own loopback"] = await _client_in(net, "http://127.0.0.1:18080", args)
        # The proxy the guest's environment names: the gateway behind its NIC where it has one, else the relay.
        label = "NIC" if res["nic"] else "relay"
        ways[f"sandbox, through its proxy ({label}) to the host's upstream"] = await _client_in(net, guest_base, args)
        if res["nic"]:  # the same VM through the channel relay (what a host without a tap gives it)
            relay = {v: PROXY_URL for v in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")}
            ways["sandbox, through the channel relay to the host's upstream"] = await _client_in(net, guest_base, args,
                                                                                                  env=relay)
        res["fetch"] = {name: {"big": summary(w["big"]), "small_total": summary(w["small_total"])}
                        for name, w in ways.items()}
        for name, w in res["fetch"].items():
            print(f"{name:52} 1 MiB p50 {w['big']['p50'] * 1000:7.1f} ms | {args.small} small requests p50 "
                  f"{w['small_total']['p50'] * 1000:8.0f} ms", flush=True)

        res["loadavg_1m_at_end"] = os.getloadavg()[0]
    finally:
        upstream.kill()
        for sid in await driver.list():
            try:
                await (await driver.open(sid)).destroy()
            except Exception as e:  # a benchmark cleans up what it can and says so
                print("cleanup failed", sid, e, file=sys.stderr)
        await driver.close()
        shutil.rmtree(work, ignore_errors=True)
    return res


def write_report(res: dict[str, Any]) -> str:
    out = ROOT / "bench" / "results" / "latest"
    out.mkdir(parents=True, exist_ok=True)
    (out / "vm-network.json").write_text(json.dumps(res, indent=2) + "\n")
    f = res["fetch"]
    local = f["sandbox, direct to its own loopback"]
    proxied = next(v for k, v in f.items() if k.startswith("sandbox, through its proxy"))
    relayed = f.get("sandbox, through the channel relay to the host's upstream")
    lines = [f"# A VM's network: fetches through its proxy, and wake with and without a network ({res['driver']} driver)",
             "",
             f"host {res['host']}, {res['cpus']} CPUs, accelerator {res['accel']}, Python {res['python']}; load average "
             f"{res['loadavg_1m_at_start']:.1f} at the start and {res['loadavg_1m_at_end']:.1f} at the end (a shared host: "
             f"read medians and differences). The same stdlib client (urllib, a new connection per request) everywhere; "
             f"{res['reps']} downloads of 1 MiB and {res['rounds']} rounds of {res['small']} small requests per way.",
             "", f"| way | 1 MiB p50 | p99 | MiB/s at p50 | {res['small']} small requests p50 | per request |",
             "|---|---|---|---|---|---|"]
    for name, w in f.items():
        lines.append(f"| {name} | {w['big']['p50'] * 1000:.1f} ms | {w['big']['p99'] * 1000:.1f} ms | "
                     f"{1 / w['big']['p50']:.1f} | {w['small_total']['p50'] * 1000:.0f} ms | "
                     f"{w['small_total']['p50'] / res['small'] * 1000:.1f} ms |")
    w = res["wake"]
    lines += ["", "| instance (a fork of its template) | wake p50 | p99 | min | max | n |", "|---|---|---|---|---|---|"]
    for label, name in (("network", f"agent with [agent.network] ({'a NIC' if res.get('nic') else 'relay only'})"),
                        ("none", "agent without a network")):
        d = w[label]
        lines.append(f"| {name} | {d['p50'] * 1000:.0f} ms | {d['p99'] * 1000:.0f} ms | {d['min'] * 1000:.0f} ms | "
                     f"{d['max'] * 1000:.0f} ms | {d['n']} |")
    for label, ph in res.get("wake_phases_p50_ms", {}).items():
        if ph:
            lines.append(f"\nwake phases p50 ({label}): " + ", ".join(f"{k} {v:.0f} ms" for k, v in ph.items()))
    via = "NIC" if res.get("nic") else "relay"
    relay_txt = (f", {relayed['big']['p50'] * 1000:.0f} ms ({1 / relayed['big']['p50']:.1f} MiB/s) through the channel "
                 f"relay" if relayed else "")
    head = (f"vm network ({res['driver']}, {res['accel']}): 1 MiB through the proxy ({via}) p50 "
            f"{proxied['big']['p50'] * 1000:.0f} ms ({1 / proxied['big']['p50']:.1f} MiB/s){relay_txt} against "
            f"{local['big']['p50'] * 1000:.0f} ms from the sandbox's own loopback; {res['small']} small requests "
            f"{proxied['small_total']['p50'] * 1000:.0f} ms against {local['small_total']['p50'] * 1000:.0f} ms "
            f"({(proxied['small_total']['p50'] - local['small_total']['p50']) / res['small'] * 1000:+.1f} ms each); "
            f"wake p50 with a network {w['network']['p50'] * 1000:.0f} ms, without {w['none']['p50'] * 1000:.0f} ms")
    lines += ["", f"**{head}**", ""]
    (out / "vm-network.md").write_text("\n".join(lines))
    return head


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--driver", default="microvm", choices=["microvm", "process"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--small", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the small requests per way")
    ap.add_argument("--wakes", type=int, default=20)
    # `moorage bench sandbox --quick` passes the sandbox runner's sizes to every script of the area.
    ap.add_argument("--forks", type=int, default=0)
    ap.add_argument("--cold", type=int, default=0)
    a = ap.parse_args()
    if a.forks:  # the quick sizes
        a.reps, a.small, a.rounds, a.wakes = min(a.reps, 5), min(a.small, 100), 1, 5
    print(write_report(asyncio.run(main(a))))
