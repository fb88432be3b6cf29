"""The attack benchmark's phase through ``moorage up`` and HTTP: the path a product takes.

A real host (``moorage up``, a process of its own) and two tenants created through the operator API: the attacker
deploys the hostile agent, the neighbour the echo agent, both with the official client (``moorage.client``). The
neighbour's turns go over HTTP, quiet and then while the attacker's own HTTP turns run each attack a guest can
start from a turn (a flood of host calls, frames nested deep, a flood of events). Host RSS is the ``moorage up``
process's own. Reported beside the in-process figures of the same run; the in-process phase is the part-level one.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Any, Callable

import httpx

from moorage.client import Client
from moorage.devservices.fleet import LocalHost

MiB = 1 << 20

#: (name, the attacker's message, what its reply must be): attacks a turn starts, same names as run.py's.
HTTP_ATTACKS: list[tuple[str, str, Callable[[str], bool]]] = [
    ("request flood (20k)", "flood 20000", lambda out: out == "flooded 20000"),
    ("nested frames (200k deep)", "deep 200000", lambda out: out == "survived"),
    ("event flood (80 MB)", "events 20000", lambda out: out == "emitted 20000"),
]


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * 4096


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))] if s else float("nan")


def _tenant(host: LocalHost, name: str) -> str:
    token = (host.data / "api" / "operator-token").read_text().strip()
    r = httpx.post(f"{host.url}/v1/tenants", json={"name": name}, headers={"Authorization": f"Bearer {token}"},
                   timeout=60)
    assert r.status_code == 201, r.text
    return str(r.json()["api_key"]["secret"])


def chosen(only: list[str]) -> list[tuple[str, str, Callable[[str], bool]]]:
    """The HTTP attacks ``--only`` selects (all without it)."""
    return [a for a in HTTP_ATTACKS if not only or any(o.lower() in a[0].lower() for o in only)]


def run_http_phase(driver: str, tmp: Path, agents: dict[str, Path], samples: int, max_turns_per_sample: int,
                   env: dict[str, str], only: list[str]) -> dict[str, Any]:
    """``agents``: the hostile and echo agents' source directories. Returns the phase's figures."""
    attacks = chosen(only)
    host = LocalHost("attacks-http", tmp / "host", env, driver=driver)
    with contextlib.ExitStack() as done:
        done.callback(host.stop)  # last: the clients below close first (last in, first out)
        attacker = done.enter_context(Client(host.url, _tenant(host, "attacker"), max_retries=0))
        neighbour = done.enter_context(Client(host.url, _tenant(host, "neighbour"), max_retries=0))
        attacker.deploy("hostile", agents["hostile"])
        neighbour.deploy("echo", agents["echo"])
        assert attacker.invoke("hostile", "ping", user="mallory")["reply"] == "pong"

        def turn() -> float:
            t = time.perf_counter()
            r = neighbour.invoke("echo", "hello", user="nina")
            assert r["reply"] == "hello", r
            return time.perf_counter() - t

        for _ in range(20):  # the neighbour awake and warm
            turn()
        for _, message, _ in attacks:  # each once before measuring: first uses start what stays
            attacker.invoke("hostile", message, user="mallory")
        quiet = [turn() for _ in range(samples * 2)]
        out: dict[str, Any] = {"quiet": {"p50_ms": _pct(quiet, 0.5) * 1e3, "p99_ms": _pct(quiet, 0.99) * 1e3,
                                         "n": len(quiet)}, "attacks": []}
        print(f"http quiet: neighbour p50 {out['quiet']['p50_ms']:.1f} ms p99 {out['quiet']['p99_ms']:.1f} ms",
              flush=True)
        for name, message, expected in attacks:
            before = [turn() for _ in range(max(10, samples // 2))]
            lat: list[float] = []
            outcomes: list[str] = []
            stop = threading.Event()
            start = peak = _rss(host.proc.pid)

            def attack() -> None:
                while not stop.is_set():
                    try:
                        outcomes.append(str(attacker.invoke("hostile", message, user="mallory")["reply"]))
                    except Exception as e:  # recorded as not contained, never hidden
                        outcomes.append(f"unexpected {type(e).__name__}: {e}")
                    if len(lat) >= samples:
                        return

            def watch() -> None:
                nonlocal peak
                while not stop.is_set():
                    peak = max(peak, _rss(host.proc.pid))
                    time.sleep(0.005)

            threads = [threading.Thread(target=attack, daemon=True), threading.Thread(target=watch, daemon=True)]
            for t in threads:
                t.start()
            while (len(lat) < samples or not outcomes) and len(lat) < max_turns_per_sample * samples:
                lat.append(turn())
            threads[0].join()
            stop.set()
            threads[1].join()
            after = attacker.invoke("hostile", "ping", user="mallory")["reply"]
            r = {"attack": name, "runs": len(outcomes), "outcomes": sorted(set(outcomes)),
                 "contained": all(expected(o) for o in outcomes) and after == "pong",
                 "host_rss_growth_mib": (peak - start) / MiB, "n": len(lat),
                 "neighbour_p50_ms": _pct(lat, 0.5) * 1e3, "neighbour_p99_ms": _pct(lat, 0.99) * 1e3,
                 "quiet_before_p99_ms": _pct(before, 0.99) * 1e3}
            out["attacks"].append(r)
            print(f"http {name}: {'contained' if r['contained'] else 'NOT CONTAINED'}; neighbour p99 "
                  f"{r['neighbour_p99_ms']:.1f} ms (quiet just before {r['quiet_before_p99_ms']:.1f} ms); "
                  f"host RSS +{r['host_rss_growth_mib']:.1f} MiB; {r['runs']} runs", flush=True)
        return out


def http_line(h: dict[str, Any]) -> str:
    worst = max(h["attacks"], key=lambda r: r["neighbour_p99_ms"])
    ok = sum(r["contained"] for r in h["attacks"])
    return (f"through moorage up and HTTP: attacks {ok} contained of {len(h['attacks'])}; neighbour p99 "
            f"{h['quiet']['p99_ms']:.0f} ms quiet, worst {worst['neighbour_p99_ms']:.0f} ms under attack "
            f"({worst['attack']})")


def http_section(h: dict[str, Any]) -> list[str]:
    md = ["", "## Through `moorage up` and HTTP", "",
          "The same neighbour and attacker as two tenants of a real `moorage up` (created through the operator API), "
          "every turn over HTTP with the official client; the attacks a turn starts. Host RSS is the `moorage up` "
          f"process's. Quiet: p50 {h['quiet']['p50_ms']:.1f} ms, p99 {h['quiet']['p99_ms']:.1f} ms "
          f"({h['quiet']['n']} turns).", "",
          "| attack | contained | neighbour p50 ms | neighbour p99 ms | p99 / quiet | quiet p99 just before ms | "
          "p99 / just before | host RSS +MiB | attack runs |", "|---|---|---|---|---|---|---|---|---|"]
    for r in h["attacks"]:
        md.append(f"| {r['attack']} | {'yes' if r['contained'] else '**no**'} | {r['neighbour_p50_ms']:.1f} | "
                  f"{r['neighbour_p99_ms']:.1f} | {r['neighbour_p99_ms'] / h['quiet']['p99_ms']:.1f}x | "
                  f"{r['quiet_before_p99_ms']:.1f} | {r['neighbour_p99_ms'] / r['quiet_before_p99_ms']:.1f}x | "
                  f"{r['host_rss_growth_mib']:.1f} | {r['runs']} |")
    md += ["", http_line(h)]
    return md
