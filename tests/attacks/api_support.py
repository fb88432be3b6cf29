"""What the hostile-tenant (API) attacks share: a store-only live API over SQLite, peak host memory read
from /proc, and a client that streams a request body that never ends.

Memory bounds are checked as peak resident growth: the kernel's high-water mark (``VmHWM``) is reset
through ``/proc/self/clear_refs`` before the attack, so any spike during it shows, not just what is left.
Fixtures here are imported by name into the ``test_api_*`` modules.
"""

from __future__ import annotations

import contextlib
import select
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator
from urllib.parse import urlsplit

import pytest

from moorage.store import Store
from moorage.store.sqlite import SQLiteBackend
from tests.api.conftest import LiveServer, start_live

MIB = 1 << 20


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


@dataclass
class PeakGrowth:
    """Bytes the process's resident set peaked above where it stood when the measurement began."""

    start_kib: int = 0
    peak_kib: int = 0

    @property
    def bytes(self) -> int:
        return max(0, self.peak_kib - self.start_kib) * 1024


@contextlib.contextmanager
def peak_rss_growth() -> Iterator[PeakGrowth]:
    """Measure the peak resident-set growth of this process (server threads included) during the block."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    g = PeakGrowth(start_kib=_status_kib("VmRSS"))
    yield g
    g.peak_kib = _status_kib("VmHWM")


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Iterator[Store]:
    s = Store(SQLiteBackend(tmp_path / "store"), max_value_bytes=64 * 1024)
    yield s
    s.close()


@pytest.fixture
def server(sqlite_store: Store, tmp_path: Path) -> Iterator[LiveServer]:
    """The real app over a real store, served by uvicorn on 127.0.0.1 (no agent runtime)."""
    yield from start_live(sqlite_store, tmp_path)


@pytest.fixture
def tenant_key(sqlite_store: Store) -> str:
    return sqlite_store.operator.create_tenant("attacker")[1].secret


@dataclass
class RawAnswer:
    status: int
    headers: dict[str, str]
    body: bytes
    sent: int  # body bytes the attacker got onto the wire before the server answered


def stream_endless_body(url: str, path: str, headers: dict[str, str], *, chunk: int = 64 * 1024,
                        give_up_after: int = 1 << 30) -> RawAnswer:
    """POST a chunked body that never ends: keep sending until the server answers, then read the answer.

    ``give_up_after`` only guards the test against a server that reads forever (that is the failure).
    """
    u = urlsplit(url)
    sock = socket.create_connection((u.hostname, u.port))
    head = [f"POST {path} HTTP/1.1", f"Host: {u.hostname}:{u.port}", "Transfer-Encoding: chunked"]
    head += [f"{k}: {v}" for k, v in headers.items()]
    sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
    frame = f"{chunk:x}\r\n".encode() + b"[" * chunk + b"\r\n"
    sent = 0
    pending = b""
    sock.setblocking(False)
    while True:
        readable, writable, _ = select.select([sock], [sock], [], 60)
        if readable:
            break
        if not writable:
            raise AssertionError("the server neither read the body nor answered")
        pending = pending or frame  # whole chunk frames only, so the framing stays valid
        try:
            n = sock.send(pending)
        except (BrokenPipeError, ConnectionResetError):
            break
        pending = pending[n:]
        sent += n
        if sent > give_up_after:
            raise AssertionError(f"the server accepted {sent >> 20} MiB of an endless body without answering")
    sock.setblocking(True)
    sock.settimeout(60)
    data = b""
    lines: list[str] = []
    hdrs: dict[str, str] = {}
    body = b""
    with contextlib.suppress(ConnectionResetError):
        while b"\r\n\r\n" not in data:
            more = sock.recv(65536)
            if not more:
                break
            data += more
        head_raw, _, body = data.partition(b"\r\n\r\n")
        lines = head_raw.decode("latin-1").split("\r\n")
        hdrs = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        length = int(hdrs.get("content-length", "0"))
        while len(body) < length:
            more = sock.recv(65536)
            if not more:
                break
            body += more
    sock.close()
    if not data:
        raise AssertionError("the connection closed without an answer")
    return RawAnswer(int(lines[0].split()[1]), hdrs, body, sent)
