"""Probe: what verifying a sleeping micro-VM's whole RAM file costs, against the 512-page sample it replaced.

One sandbox with its own RAM file (cold-booted, 256 MiB, ~100 MiB of it touched by a guest process), slept and
woken N times. Sleeps alternate between the full digest (XXH3-128 over every data extent) and the old sample,
so both are measured in the same run on the same file; each wake verifies what its sleep recorded.

    .venv/bin/python bench/attacks/snapshot_hash.py [--reps 6]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from moorage.config import Config  # noqa: E402
from moorage.sandbox import microvm_ram as ram  # noqa: E402
from moorage.sandbox.microvm import MicroVMDriver  # noqa: E402

IMAGES = Path(os.environ.get("MOORAGE_TEST_IMAGES_DIR", "/var/tmp/moorage-images"))


def med(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


async def main(reps: int) -> None:
    work = Path(tempfile.mkdtemp(prefix="moorage-hash-"))
    driver = MicroVMDriver(work / "sandboxes", Config(data_dir=work / "data"), images_dir=IMAGES)
    full_digest = ram.file_digest
    times: dict[str, dict[str, list[float]]] = {"full": {"sleep": [], "wake": [], "hash": []},
                                                "sample": {"sleep": [], "wake": [], "hash": []}}
    try:
        sb = await driver.create("hashprobe")
        await sb.start()
        # Touch ~100 MiB of guest RAM with non-zero bytes, kept by a background process across sleeps.
        await sb.exec(["sh", "-c", "nohup python3 -c \"import os, time; b = os.urandom(100 << 20); time.sleep(1e6)\" "
                                   ">/dev/null 2>&1 & sleep 3"], timeout=60)
        for i in range(reps * 2):
            kind = "full" if i % 2 == 0 else "sample"
            ram.file_digest = full_digest if kind == "full" else ram.sampled_checksum  # type: ignore[assignment]
            t = time.perf_counter()
            await sb.sleep()
            times[kind]["sleep"].append(time.perf_counter() - t)
            t = time.perf_counter()
            (full_digest if kind == "full" else ram.sampled_checksum)(sb.dir / "ram")
            times[kind]["hash"].append(time.perf_counter() - t)
            t = time.perf_counter()
            await sb.wake()
            times[kind]["wake"].append(time.perf_counter() - t)
            assert sb.last_wake_mode != "cold", sb.last_wake_fallback
        allocated = os.stat(sb.dir / "ram").st_blocks * 512
        await sb.destroy()
    finally:
        ram.file_digest = full_digest  # type: ignore[assignment]
        await driver.close()
        shutil.rmtree(work, ignore_errors=True)
    f, s = times["full"], times["sample"]
    print(f"RAM file: 256 MiB, {allocated >> 20} MiB allocated; {reps} sleeps and wakes each way")
    print(f"hash alone: full {med(f['hash']):.0f} ms, sample {med(s['hash']):.0f} ms")
    print(f"sleep p50: full {med(f['sleep']):.0f} ms, sample {med(s['sleep']):.0f} ms")
    print(f"wake p50: full {med(f['wake']):.0f} ms, sample {med(s['wake']):.0f} ms")
    print(f"full-file RAM digest adds {med(f['sleep']) - med(s['sleep']):.0f} ms to a sleep and "
          f"{med(f['wake']) - med(s['wake']):.0f} ms to a wake (p50, same run)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=6)
    asyncio.run(main(ap.parse_args().reps))
