"""What a bytecode cache saves each ``moorage`` process where none can be written (``PYTHONDONTWRITEBYTECODE=1``, as
many container images and this machine's shells set): ``moorage version``, and ``moorage up`` from its process start
to the first ``200`` of ``GET /healthz`` on a fresh data directory (embedded defaults).

Two copies of this checkout's ``src/``, one byte-compiled as ``scripts/bootstrap.sh`` does and one not, are run
alternately, ``--reps`` each, with ``PYTHONDONTWRITEBYTECODE=1`` (so the second stays without a cache); the
installed packages are the same for both (the venv's, compiled by pip).

    .venv/bin/python bench/start/bytecode.py [--reps 7]

Writes bench/results/latest/start-bytecode.{md,json}; the last line printed is the headline.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "bench" / "results" / "latest"
sys.path.insert(0, str(ROOT / "src"))
from moorage.devservices.postgres import free_port  # noqa: E402


def _env(src: Path, data: Path, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOORAGE_")}
    env.update({"PYTHONPATH": str(src), "PYTHONDONTWRITEBYTECODE": "1", "MOORAGE_DATA_DIR": str(data),
                "MOORAGE_PORT": str(port), "MOORAGE_LOG_LEVEL": "warning"})
    return env


def version_s(src: Path, scratch: Path) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "moorage.cli.main", "version"], env=_env(src, scratch / "v", 7700),
                   check=True, capture_output=True)
    return time.perf_counter() - t0


def up_s(src: Path, scratch: Path) -> float:
    data = Path(tempfile.mkdtemp(dir=scratch))
    port = free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "moorage.cli.main", "up"], env=_env(src, data / "data", port),
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise SystemExit(f"moorage up ended with {proc.returncode} before it served")
            if time.perf_counter() - t0 > 120:
                raise SystemExit("moorage up did not serve within 120 s")
            time.sleep(0.01)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        shutil.rmtree(data, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--report", default="start-bytecode")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="moorage-bytecode-") as tmp:
        scratch = Path(tmp)
        srcs = {"compiled": scratch / "compiled" / "src", "without": scratch / "without" / "src"}
        for src in srcs.values():
            shutil.copytree(ROOT / "src", src, ignore=shutil.ignore_patterns("__pycache__"))
        compileall.compile_dir(str(srcs["compiled"]), quiet=1)
        modules = sum(1 for _ in srcs["compiled"].rglob("*.py"))
        samples: dict[str, dict[str, list[float]]] = {k: {"version": [], "up": []} for k in srcs}
        for name in srcs:  # one start each, not counted (the page cache, the images directory)
            up_s(srcs[name], scratch)
        for i in range(args.reps):
            for name, src in srcs.items():
                samples[name]["version"].append(version_s(src, scratch))
                samples[name]["up"].append(up_s(src, scratch))
            print(f"rep {i + 1}/{args.reps}: " + ", ".join(
                f"{n} version {s['version'][-1] * 1000:.0f} ms up {s['up'][-1]:.2f} s" for n, s in samples.items()),
                flush=True)
    med = {n: {k: statistics.median(v) for k, v in s.items()} for n, s in samples.items()}
    headline = (f"bytecode (PYTHONDONTWRITEBYTECODE=1, {modules} moorage modules): moorage version "
                f"{med['compiled']['version'] * 1000:.0f} ms compiled vs {med['without']['version'] * 1000:.0f} ms "
                f"without; moorage up to /healthz {med['compiled']['up']:.2f} s vs {med['without']['up']:.2f} s")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{args.report}.json").write_text(json.dumps({"samples_s": samples, "median_s": med, "reps": args.reps,
                                                        "modules": modules, "headline": headline}, indent=2))
    rows = "\n".join(f"| {what} | {med['compiled'][k]:.3f} | {med['without'][k]:.3f} | "
                     f"{med['without'][k] - med['compiled'][k]:.3f} |"
                     for k, what in (("version", "`moorage version`"), ("up", "`moorage up` until `GET /healthz`")))
    (OUT / f"{args.report}.md").write_text(
        f"# Bytecode cache: what each `moorage` process start pays without one\n\n"
        f"Written by `bench/start/bytecode.py` (see its docstring). Host `{platform.node()}`, Python "
        f"{platform.python_version()}; seconds, median of {args.reps} runs of each, alternating, with "
        f"`PYTHONDONTWRITEBYTECODE=1`. 2 shared cores: compare the columns, not runs.\n\n"
        f"| command | compiled (as scripts/bootstrap.sh leaves src/) | without bytecode | saved |\n"
        f"|---|---|---|---|\n{rows}\n\n**{headline}**\n")
    print(headline)


if __name__ == "__main__":
    main()
