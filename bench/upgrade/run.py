"""Upgrading moorage while it serves, across two real versions: the previous release (``--old REV``, a git
worktree) and this checkout.

* fleet: an old-version host and a new-version host on one PostgreSQL store and one S3 bucket (SeaweedFS), as in a
  rolling upgrade (process driver): the new host's start migrates the store while the old one serves; requests
  forwarded both ways; deploys, templates, async turns and webhook deliveries from either; an instance moved both
  ways through a sleep's shipment.
* live: one host on the micro-VM driver stopped with ``--detach`` on the old version and started again on the new
  one: the re-adopted guests still run the old guest code (turns, exec, files, app port, ``ctx.spawn``, a redeploy
  of an app), and a micro-VM the old version put to sleep wakes under the new one.

    .venv/bin/python bench/upgrade/run.py --old e27f536 [--only fleet|live]

Prints one line per check (``works``, ``refused clearly`` or ``BROKEN``) and writes bench/results/latest/upgrade.md.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "upgrade"))
from checks import Checks  # noqa: E402
import fleet_scenario  # noqa: E402
import live_scenario  # noqa: E402

OUT = ROOT / "bench" / "results" / "latest" / "upgrade.md"
LOGS = Path(tempfile.gettempdir()) / "moorage-upgrade-logs"


def old_worktree(rev: str) -> Path:
    """A worktree of ``rev`` (made once, kept under the system's temporary directory); its ``src``."""
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    where = Path(tempfile.gettempdir()) / f"moorage-old-{sha}"
    if not (where / "src" / "moorage").is_dir():
        subprocess.run(["git", "worktree", "add", "--detach", str(where), sha], cwd=ROOT, check=True,
                       capture_output=True)
    return where / "src"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="the git revision of the old version (a release)")
    ap.add_argument("--only", choices=("fleet", "live"))
    args = ap.parse_args()
    old_src = old_worktree(args.old)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    checks = Checks()
    scenarios: list[tuple[str, Callable[[Checks, Path], Any]]] = [("fleet", fleet_scenario.run),
                                                                   ("live", live_scenario.run)]
    for name, run in scenarios:
        if args.only and args.only != name:
            continue
        checks.section(name)
        with tempfile.TemporaryDirectory(prefix=f"upgrade-{name}-") as base:
            try:
                run(checks, Path(base), old_src=old_src)
            except Exception as e:  # noqa: BLE001 - the scenario's remaining checks are not reached: one line says why
                checks.broken(f"{name}: the scenario stopped", f"{type(e).__name__}: {e}"[:500])
            finally:  # the hosts' logs outlive the run, for a BROKEN line's reader
                keep = LOGS / name
                shutil.rmtree(keep, ignore_errors=True)
                keep.mkdir(parents=True)
                for log in Path(base).glob("*.log"):
                    shutil.copy(log, keep / log.name)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(checks.markdown(old=args.old, new=head, machine=platform.node()))
    print(f"wrote {OUT.relative_to(ROOT)}: {checks.headline()}")


if __name__ == "__main__":
    main()
