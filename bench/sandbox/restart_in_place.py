"""A micro-VM's restart in place, the part a redeploy that changed packages or the environment waits for
(``MicroVMDriver.restart_in_place``): a supervisor forked from the guest's holder (only the environment changed)
against a fresh interpreter (``TZ`` changed, which an interpreter reads as it starts: the holder executes itself
afresh), alternating in one VM so both see the same host. The user-path figure of the same change is
``redeploy_packages.py --driver microvm`` (through ``moorage up`` and HTTP).

    python bench/sandbox/restart_in_place.py [--reps 6]

Last line: the headline.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from moorage.config import Config  # noqa: E402
from moorage.sandbox.microvm import MicroVMDriver  # noqa: E402
from tests.sandbox.conftest import _microvm_driver  # noqa: E402  (the shared guest image cache)


async def measure(reps: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"fork": [], "fresh interpreter": []}
    with tempfile.TemporaryDirectory(prefix="moorage-restart-", dir="/var/tmp") as tmp:
        root = Path(tmp)
        driver: MicroVMDriver = _microvm_driver(root / "sandboxes", Config(data_dir=root))  # type: ignore[assignment]
        sb = await driver.create("restart-bench")
        try:
            await sb.start()
            tz = "UTC"
            assert await driver.restart_in_place(sb, {"TZ": tz})  # from here the TZ it has is known
            for i in range(reps):
                for how in (("fork", "fresh interpreter") if i % 2 == 0 else ("fresh interpreter", "fork")):
                    if how == "fresh interpreter":
                        tz = "UTC0" if tz == "UTC" else "UTC"
                    before = (await sb.ping())["interpreter"]
                    t = time.perf_counter()
                    assert await driver.restart_in_place(sb, {"TZ": tz, "ROUND": f"{i}-{how}"})
                    times[how].append((time.perf_counter() - t) * 1e3)
                    same = (await sb.ping())["interpreter"] == before
                    assert same is (how == "fork"), (how, same)
        finally:
            await sb.destroy()
            await driver.close()
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=6)
    args = ap.parse_args()
    times = asyncio.run(measure(args.reps))
    for how, xs in times.items():
        print(f"{how}: p50 {statistics.median(xs):.0f} ms, min {min(xs):.0f}, max {max(xs):.0f} (n={len(xs)})")
    fork, fresh = (statistics.median(times[k]) for k in ("fork", "fresh interpreter"))
    print(f"**micro-VM restart in place p50 {fork:.0f} ms forked from the guest's holder, {fresh:.0f} ms with a fresh "
          f"interpreter (alternating in one VM, n={args.reps} each)**")


if __name__ == "__main__":
    main()
