"""The embedded model beside other work: how long one answer takes at the default thread count and at a thread
per CPU, alone and beside a second model, in the same run.

* part level: the engine in a process of its own (32-token answers), one process alone, then two at once;
* through ``moorage up`` + HTTP (the Python SDK): two hosts on this machine (process driver), each with the
  assistant example (``examples/assistant``, a model call per turn) and one user, turns on one host alone, then on
  both at once.

A turn's time depends on how long the assistant's sampled reply is (up to 96 tokens), so turn figures move between
runs more than answer figures do; a case cut off is the signal that does not. Each case has a time limit (``--limit-s``, per answer or turn): a thread pool that spins against another can take
minutes per answer, and such a case is reported as cut off, not waited for.

    .venv/bin/python bench/llm/run.py [--answers 6] [--turns 5] [--quick]

Writes bench/results/latest/llm.{md,json}; the last line printed is the headline.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "store"))
from report import latency_summary  # noqa: E402  (bench/store/report.py: what the areas share)

from moorage.cpus import usable_cpus  # noqa: E402
from moorage.llm._engine import default_threads  # noqa: E402

OUT = ROOT / "bench" / "results" / "latest"

#: One engine in its own process: a warm-up answer, then ``n`` answers of 32 tokens; prints their seconds.
_ANSWERS = r"""
import json, sys, time
from moorage.llm._engine import EngineSettings, default_model_path, get_engine
engine = get_engine(EngineSettings(default_model_path(), threads=int(sys.argv[1])))
body = {"max_tokens": 32, "ignore_eos": True, "temperature": 0}
ask = lambda i: engine.chat(dict(body, messages=[{"role": "user", "content": "Name a harbour, number %d." % i}]))
ask(-1)
for i in range(int(sys.argv[2])):
    start = time.monotonic()
    ask(i)
    print(json.dumps(time.monotonic() - start), flush=True)
"""


def _engine_case(threads: int, answers: int, procs: int, limit_s: float) -> dict[str, Any]:
    """``procs`` engines at once, ``answers`` each; answers not given within the limit count as cut off."""
    running = [subprocess.Popen([sys.executable, "-c", _ANSWERS, str(threads), str(answers)], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True) for _ in range(procs)]
    took: list[float] = []

    def read(p: subprocess.Popen[str]) -> None:
        assert p.stdout is not None
        for line in p.stdout:
            took.append(float(line))

    readers = [threading.Thread(target=read, args=(p,), daemon=True) for p in running]
    for r in readers:
        r.start()
    deadline = time.monotonic() + 30 + limit_s * answers
    for r in readers:
        r.join(max(0.0, deadline - time.monotonic()))
    for p in running:
        p.kill()
        p.wait()
    return {"threads": threads, "processes": procs, **latency_summary(took), "cut_off": procs * answers - len(took)}


def _host_case(threads: int, turns: int, both: bool, limit_s: float, work: Path) -> dict[str, Any]:
    from moorage import Client
    from moorage.devservices.fleet import LocalHost

    hosts = [LocalHost(f"h{i}", work / f"t{threads}-{int(both)}-{i}" / "data",
                       {"MOORAGE_LOG_LEVEL": "warning", "MOORAGE_LLM_THREADS": str(threads)}, driver="process",
                       start_timeout_s=300) for i in range(2)]
    took: list[float] = []
    cut = 0
    try:
        clients = [Client(h.url, h.key, timeout_s=limit_s, max_retries=0) for h in hosts]
        for c in clients:
            c.deploy("assistant", str(ROOT / "examples" / "assistant"))
            c.invoke("assistant", "Hello, I am new here.", user="u")  # the instance made, the model loaded

        def run(c: Any) -> None:
            nonlocal cut
            for i in range(turns):
                start = time.monotonic()
                try:
                    c.invoke("assistant", f"What is a good name for boat number {i}?", user="u")
                except Exception:  # noqa: BLE001 - a turn past the limit is what is counted here
                    cut += 1
                    continue
                took.append(time.monotonic() - start)

        workers = [threading.Thread(target=run, args=(c,)) for c in (clients if both else clients[:1])]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        for h in hosts:
            h.stop()
    return {"threads": threads, "hosts_busy": 2 if both else 1, **latency_summary(took), "cut_off": cut}


def _ms(case: dict[str, Any]) -> str:
    got = f"{case['p50_ms']:.0f} ms" if case.get("n") else "none"
    return got + (f" ({case['cut_off']} cut off)" if case["cut_off"] else "")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--answers", type=int, default=6)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--limit-s", type=float, default=60.0)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.answers, args.turns = 3, 2
    cpus, default = usable_cpus(), default_threads()
    configs = [default] + ([min(4, cpus)] if min(4, cpus) != default else [])
    engine = [_engine_case(t, args.answers, n, args.limit_s) for t in configs for n in (1, 2)]
    with tempfile.TemporaryDirectory(prefix="moorage-bench-llm-") as tmp:
        hosts = [_host_case(t, args.turns, both, args.limit_s, Path(tmp)) for t in configs for both in (False, True)]
    report = {"machine": {"cpus_usable": cpus, "python": platform.python_version()}, "default_threads": default,
              "engine": engine, "hosts": hosts}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "llm.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = ["# The embedded model beside other work", "",
             f"{cpus} usable CPUs; default threads {default}. p50/p99 over answers (32 tokens, part level) or turns "
             "(the assistant example through `moorage up` and the SDK, replies of varying length); cut off: past the time "
             "limit.", "",
             "| level | threads | at once | n | p50 ms | p99 ms | min-max ms | cut off |", "|---|---|---|---|---|---|---|---|"]
    for level, cases, key in (("engine", engine, "processes"), ("moorage up", hosts, "hosts_busy")):
        for c in cases:
            span = f"{c['min_ms']:.0f}-{c['max_ms']:.0f}" if c.get("n") else "-"
            p50, p99 = (f"{c['p50_ms']:.0f}", f"{c['p99_ms']:.0f}") if c.get("n") else ("-", "-")
            lines.append(f"| {level} | {c['threads']} | {c[key]} | {c.get('n', 0)} | {p50} | {p99} | {span} | {c['cut_off']} |")
    (OUT / "llm.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    parts = []
    for t in configs:
        e = {c["processes"]: c for c in engine if c["threads"] == t}
        h = {c["hosts_busy"]: c for c in hosts if c["threads"] == t}
        parts.append(f"threads {t}{' (default)' if t == default else ''}: answer {_ms(e[1])} alone, {_ms(e[2])} "
                     f"beside a second model; turn via moorage up {_ms(h[1])} alone, {_ms(h[2])} both hosts busy")
    print("llm " + "; ".join(parts))


if __name__ == "__main__":
    main()
