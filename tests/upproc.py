"""Waiting for a `moorage up` that a test started as a process, on a port the kernel chose (``--port 0``).

A test that picked a free port and then started the host on it could lose that port to another worker's host in
between; waiting for /healthz on it then reached the other host (its 401s failed the test). With port 0 the host
listens wherever the kernel puts it, and its own record (``moorage-up.json``, which names its pid) says where: the
same record the CLI and ``Client()`` on this machine read.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Callable

import httpx


def recorded(data: Path, pid: int) -> str | None:
    """The URL the host with ``pid`` recorded in ``data``, or None while the record is missing or another's."""
    try:
        record = json.loads((data / "moorage-up.json").read_text())
    except (OSError, ValueError):
        return None
    return record.get("url") if record.get("pid") == pid else None


def wait_serving(proc: subprocess.Popen, data: Path, timeout: float = 120,
                 output: Callable[[], str] = lambda: "") -> str:
    """The URL ``proc`` serves at, once it recorded it and answers /healthz there; fails with ``output()`` (its
    log) if it exits first or takes longer than ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        url = recorded(data, proc.pid)
        if url is not None:
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
        assert proc.poll() is None, f"moorage up exited ({proc.returncode}): {output()[-3000:]}"
        assert time.monotonic() < deadline, f"moorage up did not come up in {timeout:.0f} s: {output()[-3000:]}"
        time.sleep(0.1)
