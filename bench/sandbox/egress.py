"""Egress benchmark: what the gateway and ``ctx.fetch``'s client add to a loopback HTTP fetch.

A 1 MiB download and 100 small requests, each fetched directly (a minimal client with a new connection per
request, as the gateway makes, and a kept-alive httpx client), through the gateway's proxy (plain HTTP and a
CONNECT tunnel, same minimal client), and with ``moorage.egress.fetch`` — all against the same upstream in the same run. The upstream
and the gateway run in processes of their own, so the client's work is not counted as theirs.

Usage: python bench/sandbox/egress.py [--reps 30] [--small 100]
Writes bench/results/latest/egress.{md,json}; the last printed line is the headline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import httpx

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20

UPSTREAM = textwrap.dedent('''
    import asyncio, sys
    BIG = b"b" * (1 << 20)
    async def handle(r, w):
        try:
            while True:
                head = await r.readuntil(b"\\r\\n\\r\\n")
                path = head.split(b" ", 2)[1]
                body = BIG if path.endswith(b"/big") else b"ok"
                close = b"connection: close" in head.lower()
                w.write(b"HTTP/1.1 200 OK\\r\\nContent-Length: %d\\r\\n%s\\r\\n" % (len(body), b"Connection: close\\r\\n" if close else b"") + body)
                await w.drain()
                if close:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        w.close()
    async def main():
        s = await asyncio.start_server(handle, "127.0.0.1", 0)
        print(s.sockets[0].getsockname()[1], flush=True)
        await s.serve_forever()
    asyncio.run(main())
''')

GATEWAY = textwrap.dedent('''
    import asyncio
    from moorage.egress import AddressPolicy, Egress, Gateway, Limits, OperatorPolicy
    async def main():
        op = OperatorPolicy(AddressPolicy.of(False, "127.0.0.0/8"), limits=Limits(connects_per_s=100000))
        eg = Egress(op)
        g = Gateway(eg)
        b = await g.bind("bench", eg.instance({"egress": {"allow": ["http://127.0.0.1:*", "https://127.0.0.1:*"]}}), dns=False)
        print(b.proxy_port, flush=True)
        await asyncio.Event().wait()
    asyncio.run(main())
''')


def summary(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {"n": len(s), "p50": statistics.median(s), "p99": s[min(len(s) - 1, round(0.99 * (len(s) - 1)))],
            "min": s[0], "max": s[-1]}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def spawn(code: str) -> tuple[subprocess.Popen, int]:
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert p.stdout is not None
    return p, int(p.stdout.readline())


async def raw_get(host: str, port: int, target: str) -> int:
    r, w = await asyncio.open_connection(host, port)
    w.write(f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
    data = await r.read()
    w.close()
    return len(data)


async def tunnel_get(proxy_port: int, port: int, path: str) -> int:
    r, w = await asyncio.open_connection("127.0.0.1", proxy_port)
    w.write(f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n".encode())
    await r.readuntil(b"\r\n\r\n")
    w.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    data = await r.read()
    w.close()
    return len(data)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    from moorage.egress import AddressPolicy, Egress, Limits, OperatorPolicy, fetch

    up, port = spawn(UPSTREAM)
    gw, proxy_port = spawn(GATEWAY)
    base = f"http://127.0.0.1:{port}"
    eg = Egress(OperatorPolicy(AddressPolicy.of(False, "127.0.0.0/8"), limits=Limits(connects_per_s=100000)))
    inst = eg.instance({"egress": {"allow": [f"http://127.0.0.1:{port}"]}})
    keep = httpx.AsyncClient(timeout=30)

    ways: dict[str, Callable[[str], Awaitable[int]]] = {
        # The same minimal client for the first three: a new connection per request, as the gateway makes.
        "direct, new connection": lambda url: raw_get("127.0.0.1", port, url[len(base):]),
        "gateway proxy (plain HTTP)": lambda url: raw_get("127.0.0.1", proxy_port, url),
        "gateway CONNECT tunnel": lambda url: tunnel_get(proxy_port, port, url[len(base):]),
        "direct httpx, kept alive": lambda url: _len(keep.get(url)),
        "ctx.fetch client (host side)": lambda url: _flen(fetch(inst, "GET", url, max_body=2 * MiB)),
    }
    res: dict[str, Any] = {"host": platform.node(), "python": sys.version.split()[0], "cpus": os.cpu_count(),
                           "loadavg_1m_at_start": os.getloadavg()[0],
                           "reps": args.reps, "small": args.small, "rounds": args.rounds, "big": {}, "small_total": {}}
    try:
        for name, get in ways.items():  # warm every path once
            await get(base + "/big")
        # Interleaved: each round runs every way once, so drift in the host's load spreads over all of them.
        lat: dict[str, list[float]] = {name: [] for name in ways}
        totals: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(args.reps):
            for name, get in ways.items():
                t = time.perf_counter()
                n = await get(base + "/big")
                lat[name].append(time.perf_counter() - t)
                assert n >= MiB, (name, n)
        for _ in range(args.rounds):
            for name, get in ways.items():
                t = time.perf_counter()
                for _ in range(args.small):
                    await get(base + "/small")
                totals[name].append(time.perf_counter() - t)
        # CPU the gateway process spends per request: unlike wall time, it does not depend on the host's load.
        res["gateway_cpu_ms"] = {}
        for name in ("gateway proxy (plain HTTP)", "gateway CONNECT tunnel"):
            for label, path, n in (("1 MiB", "/big", max(10, args.reps)), ("small", "/small", args.small)):
                before = cpu_seconds(gw.pid)
                for _ in range(n):
                    await ways[name](base + path)
                res["gateway_cpu_ms"][f"{name}, {label}"] = (cpu_seconds(gw.pid) - before) / n * 1000
        res["loadavg_1m_at_end"] = os.getloadavg()[0]
        for name in ways:
            res["big"][name], res["small_total"][name] = summary(lat[name]), summary(totals[name])
            print(f"{name:30} 1 MiB p50 {res['big'][name]['p50'] * 1000:6.2f} ms "
                  f"({1 / res['big'][name]['p50']:6.0f} MiB/s) | {args.small} small requests "
                  f"p50 {res['small_total'][name]['p50'] * 1000:7.1f} ms", flush=True)
    finally:
        await keep.aclose()
        up.kill()
        gw.kill()
    return res


async def _len(resp: Awaitable[httpx.Response]) -> int:
    return len((await resp).content)


async def _flen(r: Awaitable[Any]) -> int:
    return len((await r).body)


def write_report(res: dict[str, Any]) -> str:
    out = ROOT / "bench" / "results" / "latest"
    out.mkdir(parents=True, exist_ok=True)
    (out / "egress.json").write_text(json.dumps(res, indent=2) + "\n")
    base_big = res["big"]["direct, new connection"]["p50"]
    base_small = res["small_total"]["direct, new connection"]["p50"]
    lines = ["# Egress: gateway and ctx.fetch against a direct loopback fetch", "",
             f"host {res['host']}, {res['cpus']} CPUs (load average {res['loadavg_1m_at_start']:.1f} at the start, "
             f"{res['loadavg_1m_at_end']:.1f} at the end: wall times on a busy host carry its scheduling delays, "
             f"the gateway's CPU per request below does not), Python {res['python']}; {res['reps']} downloads of 1 MiB and "
             f"{res['rounds']} rounds of {res['small']} small requests per way, interleaved, sequential, upstream and gateway in their own "
             "processes.", "",
             "| way | 1 MiB p50 | p99 | MiB/s at p50 | added to direct (new connection) | "
             f"{res['small']} small requests p50 | added per request |",
             "|---|---|---|---|---|---|---|"]
    for name, big in res["big"].items():
        small = res["small_total"][name]["p50"]
        lines.append(f"| {name} | {big['p50'] * 1000:.2f} ms | {big['p99'] * 1000:.2f} ms | {1 / big['p50']:.0f} | "
                     f"{(big['p50'] - base_big) * 1000:+.2f} ms | {small * 1000:.1f} ms | "
                     f"{(small - base_small) / res['small'] * 1000:+.3f} ms |")
    lines += ["", "CPU the gateway process spends per request (load-independent; 10 ms clock ticks, so small figures are "
              "averages over many requests):", "", "| way, size | gateway CPU per request |", "|---|---|"]
    lines += [f"| {k} | {v:.2f} ms |" for k, v in res["gateway_cpu_ms"].items()]
    (out / "egress.md").write_text("\n".join(lines) + "\n")
    gw_big, gw_small = res["big"]["gateway proxy (plain HTTP)"]["p50"], res["small_total"]["gateway proxy (plain HTTP)"]["p50"]
    fe_big = res["big"]["ctx.fetch client (host side)"]["p50"]
    return (f"egress gateway: 1 MiB p50 {gw_big * 1000:.1f} ms ({1 / gw_big:.0f} MiB/s) against direct "
            f"{base_big * 1000:.1f} ms ({(gw_big - base_big) * 1000:+.1f} ms); {res['small']} small requests "
            f"{gw_small * 1000:.0f} ms against {base_small * 1000:.0f} ms "
            f"({(gw_small - base_small) / res['small'] * 1000:+.2f} ms each); ctx.fetch client 1 MiB p50 "
            f"{fe_big * 1000:.1f} ms; gateway CPU per request: 1 MiB "
            f"{res['gateway_cpu_ms']['gateway proxy (plain HTTP), 1 MiB']:.2f} ms, small "
            f"{res['gateway_cpu_ms']['gateway proxy (plain HTTP), small']:.2f} ms")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--small", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the small requests per way")
    # `moorage bench sandbox --quick` passes the sandbox runner's sizes to every script of the area.
    ap.add_argument("--forks", type=int, default=0)
    ap.add_argument("--cold", type=int, default=0)
    a = ap.parse_args()
    print(write_report(asyncio.run(main(a))))
