"""Process driver: an agent's deploy-time packages copied into every fork's layer, or bound read-only from the
template (``make_template(..., shared=[SITE_DIR])``), measured in the same run on the same template contents.

    python bench/sandbox/shared_packages.py [--site DIR] [--forks 5] [--turns 10]
    python bench/sandbox/shared_packages.py --http [--baseline-src DIR] [--users 4]

``--site`` is an installed package tree to put in the template's /work/.moorage/site (default: LangGraph and its
dependencies, installed once with pip into /var/tmp/moorage-bench-site from the configured index). Per mode: a
fork per new user, its first start and import of the packages, a checkpoint after each turn that changes one small
file, the layer's disk per user. Last line: the headline.

``--http``: the path a user takes instead. ``moorage up`` (process driver, embedded defaults, a loopback package
index serving LangGraph's wheels from this venv) deploys ``examples/langgraph`` as shipped (automatic checkpoints
on), then new users each send a first turn and one user sends turns to its awake agent, over HTTP with the
``openai`` client. ``--baseline-src`` (a checkout's ``src`` of an earlier version, e.g. a ``git worktree``) runs
the same server code from there, alternated with this one's, for the before/after in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moorage.config import Config
from moorage.runtime.deploy_packages import SITE_DIR
from moorage.sandbox.process import ProcessDriver
from moorage.sandbox.process_fs import disk_usage

DEFAULT_SITE = Path("/var/tmp/moorage-bench-site")
RESULTS = Path(__file__).resolve().parents[1] / "results" / "latest"
_lines: list[str] = []


def say(line: str) -> None:
    """Print ``line`` and keep it for the report (``bench/results/latest/shared-packages[-http].md``)."""
    print(line, flush=True)
    _lines.append(line)


def _report(name: str, title: str) -> None:
    import platform

    RESULTS.mkdir(parents=True, exist_ok=True)
    head = [f"# {title}", "", f"Python {platform.python_version()}, {os.cpu_count()} CPUs (shared, noisy), "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. `{' '.join(sys.argv)}`", ""]
    (RESULTS / name).write_text("\n".join(head + _lines) + "\n")


def _site(path: Path | None) -> Path:
    if path is not None:
        return path
    if not (DEFAULT_SITE / "langgraph").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(DEFAULT_SITE), "langgraph>=1.0"],
                       check=True)
    return DEFAULT_SITE


def _p50(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


async def _mode(driver: ProcessDriver, site: Path, shared: bool, forks: int, turns: int) -> dict[str, float]:
    tag = "shared" if shared else "copied"
    b = await driver.create(f"builder-{tag}")
    await b.start()
    await b.exec(["mkdir", "-p", SITE_DIR])
    await b.stop()
    # The tree straight into the builder's layer (what pip --target leaves there), owned like the layer.
    subprocess.run(["cp", "-a", f"{site}/.", str(b.layer / SITE_DIR.lstrip("/"))], check=True)
    await b.start()
    t = await driver.make_template(b, f"tpl-{tag}", shared=[SITE_DIR] if shared else [])
    await b.destroy()
    fork_ms, first_ms, ck_ms, disk = [], [], [], []
    for i in range(forks):
        t0 = time.perf_counter()
        (c,) = await driver.fork(t, [f"{tag}-{i}"])
        t1 = time.perf_counter()
        await c.start()
        r = await c.exec(["python3", "-c", f"import sys; sys.path.insert(0, '{SITE_DIR}'); import langgraph.graph"])
        t2 = time.perf_counter()
        assert r.exit_code == 0, r.stderr[-500:]
        fork_ms.append((t1 - t0) * 1e3)
        first_ms.append((t2 - t0) * 1e3)
        for n in range(turns):
            await c.write_file("/work/turn.txt", f"turn {n}\n".encode())
            t3 = time.perf_counter()
            await c.checkpoint(f"t{n}")
            ck_ms.append((time.perf_counter() - t3) * 1e3)
        disk.append(disk_usage(c.layer))
        await c.destroy()
    await driver.delete_template(t)
    return {"fork_ms": _p50(fork_ms), "first_ms": _p50(first_ms), "ck_ms": _p50(ck_ms),
            "ck_first_ms": _p50(ck_ms[::turns]), "ck_later_ms": _p50([x for j, x in enumerate(ck_ms) if j % turns]),
            "disk_mib": _p50(disk) / 2**20}


async def _http_once(src: Path, users: int, awake: int, index_url: str, work: Path) -> dict[str, float]:
    """One ``moorage up`` running ``src``'s code: the deploy, each new user's first turn, awake turns (ms)."""
    import os
    import signal

    import httpx
    from openai import AsyncOpenAI

    from moorage.cli.up import tar_dir

    port = _free_port()
    data = work / f"data-{port}"
    data.mkdir()
    env = {**os.environ, "PYTHONPATH": str(src), "MOORAGE_DATA_DIR": str(data), "MOORAGE_PORT": str(port),
           "MOORAGE_SANDBOX_DRIVER": "process", "MOORAGE_EGRESS_ALLOW_CIDRS": "127.0.0.0/8",
           "MOORAGE_EGRESS_PACKAGE_INDEX": index_url, "MOORAGE_PACKAGE_INDEX_URL": index_url + "/simple/"}
    log = open(work / f"server-{port}.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "moorage.cli.main", "up"], env=env, stdout=log, stderr=log,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=url, timeout=900) as api:
            deadline = time.monotonic() + 300
            while True:
                try:
                    if (await api.get("/healthz", timeout=1)).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moorage up did not come up: {work}/server-{port}.log")
                await asyncio.sleep(0.2)
            key = (data / "local-admin.key").read_text().strip()
            api.headers["Authorization"] = f"Bearer {key}"
            example = Path(__file__).resolve().parents[2] / "examples" / "langgraph"
            t0 = time.perf_counter()
            r = await api.post("/v1/agents/notebook/deployments", content=tar_dir(example),
                               headers={"Content-Type": "application/gzip"})
            if r.status_code >= 400:
                raise RuntimeError(f"deploy failed: {r.status_code} {r.text}")
            deploy_s = time.perf_counter() - t0
            async with AsyncOpenAI(base_url=f"{url}/v1", api_key=key, timeout=900, max_retries=0) as oai:
                async def turn(user: str, text: str) -> float:
                    t = time.perf_counter()
                    out = await oai.chat.completions.create(model="notebook", user=user,
                                                            messages=[{"role": "user", "content": text}])
                    assert (out.choices[0].message.content or "").startswith("notes:"), out
                    return (time.perf_counter() - t) * 1e3
                new = [await turn(f"u{i}", "note hello") for i in range(users)]
                awake_ms = [await turn("u0", f"note n{i}") for i in range(awake)]
        disk = sum(disk_usage(d) for d in (data / "sandboxes").iterdir() if not d.name.startswith("."))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    # The part beside the path: the sandbox half of each automatic checkpoint, as the server logged it.
    import re

    cks = [(float(m.group(2)), int(m.group(1))) for m in re.finditer(
        r"process_checkpoints: checkpoint .*?linked=(\d+) .*?ms=([\d.]+)",
        (work / f"server-{port}.log").read_text(errors="replace"))]
    return {"deploy_s": deploy_s, "new_ms": _p50(new), "awake_ms": _p50(awake_ms),
            "ck_ms": _p50([ms for ms, _ in cks]), "linked": _p50([float(n) for _, n in cks]),
            "disk_mib": disk / 2**20 / users}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def http_main(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.langgraph.wheelhouse import build_index, serve

    here = Path(__file__).resolve().parents[2] / "src"
    runs = [("baseline", args.baseline_src), ("this", here)] if args.baseline_src else [("this", here)]
    with tempfile.TemporaryDirectory(prefix="moorage-shared-http-", dir="/var/tmp") as tmp:
        work = Path(tmp)
        (work / "index").mkdir()
        build_index(work / "index", "langgraph")
        # 127.0.0.2: a loopback address that pip in the sandbox reaches through its proxy (127.0.0.1 and localhost
        # it would try directly), and the gateway admits (127.0.0.0/8).
        ports = serve(work / "index", "127.0.0.2")
        index_url = f"http://127.0.0.2:{next(ports)}"
        res: dict[str, dict[str, list[float]]] = {}
        for _ in range(args.rounds):
            for name, src in runs:
                r = await _http_once(Path(src), args.users, args.awake, index_url, work)
                say(f"- {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in r.items()))
                for k, v in r.items():
                    res.setdefault(name, {}).setdefault(k, []).append(v)
        ports.close()
    say("")
    say(f"| through `moorage up` and HTTP, p50 of {args.rounds} runs | " + " | ".join(n for n, _ in runs) + " |")
    say("|---|" + "---:|" * len(runs))
    for label, key, unit in [("deploy (pip into the template)", "deploy_s", "s"), ("new user's first turn", "new_ms", "ms"),
                             ("turn to an awake agent (checkpoint after each)", "awake_ms", "ms"),
                             ("of which the sandbox's checkpoint (server log, same run)", "ck_ms", "ms"),
                             ("files hard-linked per checkpoint", "linked", ""),
                             ("sandbox disk per user (templates apart)", "disk_mib", "MiB")]:
        say(f"| {label} | " + " | ".join(f"{_p50(res[n][key]):.1f} {unit}" for n, _ in runs) + " |")
    line = "; ".join(f"{n}: new user {_p50(res[n]['new_ms']):.0f} ms, awake turn {_p50(res[n]['awake_ms']):.0f} ms "
                     f"(its checkpoint {_p50(res[n]['ck_ms']):.1f} ms), {_p50(res[n]['disk_mib']):.1f} MiB per user"
                     for n, _ in runs)
    say("")
    say(f"**langgraph example through moorage up (process): {line}**")
    _report("shared-packages-http.md", "Process driver: an agent's packages shared by its forks, through `moorage up`")


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--site", type=Path)
    ap.add_argument("--forks", type=int, default=5)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--http", action="store_true")
    ap.add_argument("--baseline-src", type=Path)
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--awake", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    if args.http:
        await http_main(args)
        return
    site = _site(args.site)
    files = sum(1 for _ in site.rglob("*"))
    say(f"site: {site} ({disk_usage(site) / 2**20:.0f} MiB, {files} entries); {args.forks} forks x {args.turns} "
        "turns per mode, each mode twice, alternated")
    say("")
    with tempfile.TemporaryDirectory(prefix="moorage-shared-bench-", dir="/var/tmp") as tmp:
        driver = ProcessDriver(Path(tmp) / "sandboxes", Config(data_dir=Path(tmp)))
        res = {}
        try:
            for shared in (False, True, False, True):  # alternated: a drift in the host's load hits both
                r = await _mode(driver, site, shared, args.forks, args.turns)
                for k, v in r.items():
                    res.setdefault(shared, {}).setdefault(k, []).append(v)
        finally:
            await driver.close()
    say("| per new user / turn, p50 | copied into each layer | bound from the template |")
    say("|---|---:|---:|")
    rows = [("fork", "fork_ms", "ms"), ("fork + start + import langgraph", "first_ms", "ms"),
            ("checkpoint after a turn (all)", "ck_ms", "ms"), ("first checkpoint", "ck_first_ms", "ms"),
            ("later checkpoints", "ck_later_ms", "ms"), ("layer on disk", "disk_mib", "MiB")]
    for label, key, unit in rows:
        a, b = _p50(res[False][key]), _p50(res[True][key])
        say(f"| {label} | {a:.1f} {unit} | {b:.1f} {unit} |")
    c, s = res[False], res[True]
    say("")
    say(f"**process packages: fork {_p50(c['fork_ms']):.0f} -> {_p50(s['fork_ms']):.0f} ms; "
          f"checkpoint p50 {_p50(c['ck_ms']):.1f} -> {_p50(s['ck_ms']):.1f} ms; "
          f"layer {_p50(c['disk_mib']):.1f} -> {_p50(s['disk_mib']):.2f} MiB per user**")
    _report("shared-packages.md", "Process driver: an agent's packages copied into each fork, or shared")


if __name__ == "__main__":
    asyncio.run(main())
