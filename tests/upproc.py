"""Starting and waiting for a `moorage up` that a test runs as a process, on a port the kernel chose (``--port 0``).

A test that picked a free port and then started the host on it could lose that port to another worker's host in
between; waiting for /healthz on it then reached the other host (its 401s failed the test). With port 0 the host
listens wherever the kernel puts it, and its own record (``moorage-up.json``, which names its pid) says where: the
same record the CLI and ``Client()`` on this machine read.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import httpx

ROOT = Path(__file__).resolve().parents[1]
MOORAGE = [sys.executable, "-m", "moorage.cli.main"]


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


@contextlib.contextmanager
def moorage_up(data: Path, env: dict[str, str], log: Path, *args: str,
               prefix: tuple[str, ...] = ()) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """`moorage up ARGS` on ``data`` (``env`` names it and the port, 0 for one the kernel picks; ``prefix``: a
    command it runs under), its output appended to ``log``: the process and its URL once it serves. Stopped as
    systemd stops it (SIGTERM, then SIGKILL to its group past two minutes) if still running at the end."""
    with open(log, "ab") as out:
        proc = subprocess.Popen([*prefix, *MOORAGE, "up", *args], env=env, cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc, wait_serving(proc, data, output=lambda: log.read_text(errors="replace"))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


@contextlib.contextmanager
def squatter() -> Iterator[int]:
    """Another process's server on a loopback port, answering 200 to every GET (/healthz too): the port a harness
    chose for its host, taken first."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Healthy(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Healthy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
