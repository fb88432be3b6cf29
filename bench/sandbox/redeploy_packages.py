"""What a user who already has an instance waits for on the first turn after a redeploy, through ``moorage up`` and
HTTP: a redeploy that changes only code (the baseline: the new code is loaded into the sandbox) against one whose
``requirements.txt`` adds a package (the sandbox gets the new packages first, then restarts:
``runtime/instance_update.py``), or (``--what apt``, micro-VM) whose ``[agent] apt`` list adds a Debian package
(installed in place, no restart), in the same run on the same users.

    python bench/sandbox/redeploy_packages.py [--driver process|microvm] [--what requirements|apt] [--users 4] [--rounds 2]

Agent ``tab`` (``tabulate``, then ``tabulate`` + ``sniffio``) from a loopback package index built from this venv's
wheels; with ``--what apt``, Debian packages ``bench-a``, then ``bench-a`` + ``bench-b`` from a loopback mirror
(``tests/egress/debian_mirror.py``). Per round: a code-only redeploy, then a package-changing one, each followed by
one turn of every existing user (half of them asleep when it lands) and a second turn; the server's own log gives
the part-level figure of the same run (``instance changed with its deployment ... ms=``). Last line: the headline.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from moorage.cli.up import tar_dir  # noqa: E402
from moorage.client.sync import Client  # noqa: E402
from moorage.devservices.fleet import LocalHost  # noqa: E402
from tests.egress.debian_mirror import build_mirror  # noqa: E402
from tests.langgraph.wheelhouse import build_index, serve  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "latest"
AGENT = '''
import {modules}

VERSION = {version!r}


async def on_message(ctx, message):
    return VERSION + " " + ",".join(m.__name__ for m in ({modules},))
'''
#: ``--what apt``: each package's command prints its name.
AGENT_APT = '''
VERSION = {version!r}


async def on_message(ctx, message):
    r = await ctx.exec(["sh", "-c", {script!r}])
    return VERSION + " " + ",".join(r["stdout"].split())
'''
_lines: list[str] = []


def say(line: str) -> None:
    print(line, flush=True)
    _lines.append(line)


def _p50(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _agent(base: Path, version: int, packages: list[str], apt: bool) -> Path:
    d = base / f"tab-{version}"
    d.mkdir()
    listed = f"apt = {packages!r}\n".replace("'", '"') if apt else ""
    (d / "moorage.toml").write_text(f'[agent]\nname = "tab"\nentry = "agent.py"\n{listed}'
                                    '[agent.lifecycle]\nusers = "auto"\n')
    if apt:
        (d / "agent.py").write_text(AGENT_APT.format(script="; ".join(packages), version=f"v{version}"))
    else:
        (d / "agent.py").write_text(AGENT.format(modules=", ".join(packages), version=f"v{version}"))
        (d / "requirements.txt").write_text("".join(p + "\n" for p in packages))
    return d


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--driver", default="process", choices=["process", "microvm"])
    ap.add_argument("--what", default="requirements", choices=["requirements", "apt"])
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    apt = args.what == "apt"
    if apt and args.driver != "microvm":
        ap.error("--what apt needs --driver microvm (Debian packages install as root in a VM)")
    changed = "[agent] apt" if apt else "requirements.txt"
    with tempfile.TemporaryDirectory(prefix="moorage-redeploy-", dir="/var/tmp") as tmp:
        work = Path(tmp)
        (work / "index").mkdir()
        if apt:
            build_mirror(work / "index", {n: ("", n) for n in ("bench-a", "bench-b", "bench-c")})
        else:
            build_index(work / "index", "tabulate", "sniffio", "six")
        ports = serve(work / "index", "127.0.0.2")
        index = f"http://127.0.0.2:{next(ports)}"
        settings = ({"MOORAGE_EGRESS_PACKAGE_INDEX": index + "/debian/", "MOORAGE_PACKAGE_APT_URL": index + "/debian",
                     "MOORAGE_PACKAGE_APT_TRUSTED": "1"} if apt else
                    {"MOORAGE_EGRESS_PACKAGE_INDEX": index, "MOORAGE_PACKAGE_INDEX_URL": index + "/simple/"})
        host = LocalHost("up", work / "data", {"MOORAGE_EGRESS_ALLOW_CIDRS": "127.0.0.0/8", **settings},
                         driver=args.driver, start_timeout_s=900)
        times: dict[str, list[float]] = {}
        try:
            with Client(host.url, host.key) as api:
                version = 0
                packages = ["bench-a"] if apt else ["tabulate"]

                def deploy() -> None:
                    nonlocal version
                    version += 1
                    _post(host, tar_dir(_agent(work, version, packages, apt)))

                def turn(user: str) -> float:
                    t = time.perf_counter()
                    reply = str(api.invoke("tab", "hi", user=user)["reply"])
                    assert reply == f"v{version} " + ",".join(packages), (reply, version, packages)
                    return (time.perf_counter() - t) * 1e3

                users = [f"u{i}" for i in range(args.users)]
                deploy()
                for u in users:
                    turn(u)
                boxes = {b["scope"]: b["id"] for b in api.list_sandboxes(agent="tab")["data"]}
                extra = ["bench-b", "bench-c"] if apt else ["sniffio", "six"]
                for r in range(args.rounds):
                    for kind in ("code only", "packages changed"):
                        for u in users[: len(users) // 2]:  # half of them asleep when the redeploy lands
                            api.sandbox_action(boxes[f"user:tab/{u}"], "sleep")
                        if kind == "packages changed":
                            packages = [packages[0], extra[r % len(extra)]]
                        deploy()
                        times.setdefault(f"{kind}: first turn", []).extend(turn(u) for u in users)
                        times.setdefault(f"{kind}: second turn", []).extend(turn(u) for u in users)
        finally:
            host.stop()
            ports.close()
        log = host.log.read_text(errors="replace")
        found = [(int(m.group(1)), int(m.group(2)), float(m.group(3)), float(m.group(4))) for m in re.finditer(
            r"instance changed with its deployment.*?restarts=(\d+) in_place=(\d+) restart_ms=([\d.]+) ms=([\d.]+)",
            log)]
        restarts, parts = [r for _, _, r, _ in found], [ms for _, _, _, ms in found]
        how = (f"{sum(n for _, n, _, _ in found)} of {sum(n for n, _, _, _ in found)} in place, the others "
               f"stop + {'cold boot' if args.driver == 'microvm' else 'start'}")
    say(f"{args.driver} driver, {changed} changed, {args.users} users (half asleep when each redeploy lands), "
        f"{args.rounds} rounds; through `moorage up` and the SDK client (HTTP)")
    say("")
    say("| p50 (ms) | first turn after the redeploy | second turn |")
    say("|---|---:|---:|")
    for kind in ("code only", "packages changed"):
        say(f"| {kind} | {_p50(times[f'{kind}: first turn']):.0f} | {_p50(times[f'{kind}: second turn']):.0f} |")
    say(f"| of which the sandbox's packages changed{'' if apt else ' and restarted'} (server log, same run; "
        f"n={len(parts)}) | "
        f"{_p50(parts):.0f} | |")
    say(f"| of which the restart ({how}) | "
        f"{_p50(restarts):.0f} | |")
    say("")
    say(f"**redeploy reaches existing users ({args.driver}): first turn after a code-only redeploy p50 "
        f"{_p50(times['code only: first turn']):.0f} ms; after one that changed {changed} "
        f"{_p50(times['packages changed: first turn']):.0f} ms (packages + restart {_p50(parts):.0f} ms, of which "
        f"restart {_p50(restarts):.0f} ms, server log)**")
    RESULTS.mkdir(parents=True, exist_ok=True)
    head = [f"# A redeploy's packages ({changed}) reach existing users ({args.driver})", "",
            f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs (shared, noisy), "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. `{' '.join(sys.argv)}`", ""]
    (RESULTS / f"redeploy-{'apt' if apt else 'packages'}-{args.driver}.md").write_text("\n".join(head + _lines) + "\n")


def _post(host: LocalHost, archive: bytes) -> None:
    with host.client(host.key) as c:
        r = c.post("/v1/agents/tab/deployments", content=archive, headers={"Content-Type": "application/gzip"})
        if r.status_code >= 400:
            raise RuntimeError(f"deploy failed: {r.status_code} {r.text}")


if __name__ == "__main__":
    main()
