"""What a deploy's builder costs on the micro-VM driver: ``moorage deploy`` through a ``moorage up`` host, with booted
builders (this checkout: ``runtime/booted.py``) against the same host without them (``--baseline``, a git revision
before them), in one run.

Each variant gets its own ``moorage up`` (fresh data directory, the guest image shared) and is deployed
``--reps`` + 1 times, alternating between the variants: a changed ``examples/assistant`` each time (a new
deployment, so a new template build). The first deploy on a fresh host boots its builder in both variants (this
checkout then keeps its booted state); the later ones are what an agent's developer waits for at each redeploy.
Timed: the ``moorage deploy`` process (the official CLI, over HTTP) and, part-level from the host's log, its
builder's start (``cold boot ... ms=`` or ``resumed this host's booted sandbox ... (N ms)``). Both hosts get the
accelerator this machine's KVM probe chose (``MOORAGE_ACCEL``), so neither waits for a probe of its own (once per
machine boot, on its first deploy).

    .venv/bin/python bench/sandbox/deploy_build.py [--reps 5] [--baseline c243332] [--images DIR]

Writes bench/results/latest/deploy-build.{md,json}; the last line printed is the headline.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "bench" / "results" / "latest"
sys.path.insert(0, str(ROOT / "src"))
from moorage.config import Config  # noqa: E402
from moorage.devservices.fleet import LocalHost  # noqa: E402
from moorage.sandbox.microvm import MicroVMDriver  # noqa: E402

sys.path.insert(0, str(ROOT / "bench" / "store"))
from report import baseline_src  # noqa: E402  (bench/store/report.py: what the areas share)

#: The last commit before booted builders.
BEFORE = "c243332"
_COLD = re.compile(r"cold boot sandbox=tpl-\S+ ms=(\d+)")
_RESUMED = re.compile(r"resumed this host's booted sandbox of this size \((\d+) ms\)")


class Host:
    def __init__(self, name: str, src: Path, scratch: Path, images: Path, accel: str) -> None:
        self.name = name
        # ``moorage up`` on a fresh data directory sharing the image, until it serves (the fleet tests' LocalHost).
        self.up = LocalHost(name, scratch / name / "data", {"PYTHONPATH": str(src), "MOORAGE_ACCEL": accel,
                                                             "MOORAGE_TEST_IMAGES_DIR": str(images)},
                            driver="microvm", start_timeout_s=600)
        self.log = self.up.log
        self.env = {**os.environ, "PYTHONPATH": str(src), "MOORAGE_DATA_DIR": str(self.up.data),
                    "MOORAGE_PORT": str(self.up.port)}

    def deploy(self, agent: Path) -> tuple[float, float]:
        """Seconds of ``moorage deploy``, and the builder's start in ms read from the host's log."""
        seen = self.log.stat().st_size
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "moorage.cli.main", "deploy", str(agent)], env=self.env,
                           capture_output=True, text=True)
        took = time.perf_counter() - t0
        if r.returncode != 0:
            raise SystemExit(f"{self.name}: moorage deploy failed: {r.stderr[-2000:]}")
        with self.log.open("rb") as f:
            f.seek(seen)
            tail = f.read().decode(errors="replace")
        found = _RESUMED.search(tail) or _COLD.search(tail)
        if found is None:
            raise SystemExit(f"{self.name}: no builder start in the host's log:\n{tail[-2000:]}")
        return took, float(found.group(1))

    def stop(self) -> None:
        self.up.sigterm(120)


def _agent(scratch: Path, name: str, i: int) -> Path:
    d = scratch / "agents" / f"{name}-{i}"
    shutil.copytree(ROOT / "examples" / "assistant", d)
    with (d / "agent.py").open("a") as f:
        f.write(f"\n# bench build {name} {i}\n")  # another package: another deployment and template
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5, help="redeploys per variant after the first deploy")
    ap.add_argument("--baseline", default=BEFORE, help="git revision of the variant without booted builders")
    ap.add_argument("--images", type=Path, default=Path("/var/tmp/moorage-images"),
                    help="the guest image cache both hosts share (built by the first host when empty)")
    ap.add_argument("--report", default="deploy-build")
    args = ap.parse_args()
    args.images.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="moorage-deploy-build-") as tmp:
        scratch = Path(tmp)
        srcs = {"booted": ROOT / "src", "before": baseline_src(args.baseline, scratch)}
        compileall.compile_dir(str(srcs["before"]), quiet=1)  # as scripts/bootstrap.sh leaves src/
        accel = MicroVMDriver(scratch / "probe", Config(data_dir=scratch / "probe"), images_dir=args.images).accel
        hosts = {name: Host(name, src, scratch, args.images, accel) for name, src in srcs.items()}
        samples: dict[str, dict[str, list[float]]] = {n: {"deploy_s": [], "builder_ms": []} for n in hosts}
        try:
            for i in range(args.reps + 1):
                for name, host in hosts.items():
                    took, builder = host.deploy(_agent(scratch, name, i))
                    samples[name]["deploy_s"].append(took)
                    samples[name]["builder_ms"].append(builder)
                print(f"deploy {i + 1}/{args.reps + 1}: " + ", ".join(
                    f"{n} {s['deploy_s'][-1]:.2f} s (builder {s['builder_ms'][-1]:.0f} ms)" for n, s in samples.items()),
                    flush=True)
        finally:
            for host in hosts.values():
                host.stop()
    first = {n: {k: v[0] for k, v in s.items()} for n, s in samples.items()}
    later = {n: {k: statistics.median(v[1:]) for k, v in s.items()} for n, s in samples.items()}
    headline = (f"deploy build (moorage deploy over HTTP, microvm, {accel}): redeploy p50 {later['booted']['deploy_s']:.2f} s "
                f"vs {later['before']['deploy_s']:.2f} s before (builder start {later['booted']['builder_ms']:.0f} ms "
                f"resumed vs {later['before']['builder_ms']:.0f} ms booted); first deploy on a fresh host "
                f"{first['booted']['deploy_s']:.2f} s vs {first['before']['deploy_s']:.2f} s")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{args.report}.json").write_text(json.dumps({"samples": samples, "first": first, "later_median": later,
                                                        "reps": args.reps, "baseline": args.baseline, "accel": accel,
                                                        "headline": headline}, indent=2))
    rows = "\n".join(f"| {what} | {d['booted'][k]:.{p}f} | {d['before'][k]:.{p}f} |"
                     for what, d, k, p in (("first deploy, `moorage deploy` (s)", first, "deploy_s", 2),
                                           ("first deploy, builder start (ms)", first, "builder_ms", 0),
                                           (f"redeploy p50 of {args.reps}, `moorage deploy` (s)", later, "deploy_s", 2),
                                           (f"redeploy p50 of {args.reps}, builder start (ms)", later, "builder_ms", 0)))
    (OUT / f"{args.report}.md").write_text(
        f"# Deploy builds: booted builders against booting each builder\n\n"
        f"Written by `bench/sandbox/deploy_build.py` (see its docstring). Host `{platform.node()}`, micro-VM driver; "
        f"baseline: `{args.baseline}`, the same host code without booted builders, deployed alternately in the same "
        f"run. 2 shared cores: compare the columns, not runs.\n\n"
        f"| | booted builders | before |\n|---|---|---|\n{rows}\n\n**{headline}**\n")
    print(headline)


if __name__ == "__main__":
    main()
