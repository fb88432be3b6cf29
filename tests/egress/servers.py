"""Loopback servers the egress tests talk to: "the internet" of these tests is 127.0.0.1, nothing else.

``Upstream`` records every request it gets (path and headers), so a test can show that a refused request
never reached it; a few paths answer specially (redirects, an endless body, a big download).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MIB = 1 << 20


@dataclass
class Hit:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes = b""


@dataclass
class Upstream:
    name: str
    server: Any = None
    hits: list[Hit] = field(default_factory=list)
    redirects: dict[str, tuple[int, str]] = field(default_factory=dict)

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def paths(self) -> list[str]:
        return [h.path for h in self.hits]


def start_upstream(name: str) -> Upstream:
    up = Upstream(name)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a: Any) -> None:
            pass

        def _serve(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(n) if n else b""
            if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
                while True:
                    size = int(self.rfile.readline().split(b";")[0], 16)
                    body += self.rfile.read(size)
                    self.rfile.readline()
                    if size == 0:
                        break
            up.hits.append(Hit(self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body))
            path = self.path.split("?", 1)[0]
            if path in up.redirects:
                status, location = up.redirects[path]
                self.send_response(status)
                self.send_header("Location", location)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if path == "/endless":
                # No length, no end: the body goes on until the client hangs up.
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                chunk = b"x" * 65536
                try:
                    while True:
                        self.wfile.write(chunk)
                except (BrokenPipeError, ConnectionResetError, OSError):
                    return
            if path == "/slow":
                # Headers and a first byte, then nothing for a long time: only a total deadline ends this.
                self.send_response(200)
                self.send_header("Content-Length", "1000000")
                self.end_headers()
                self.wfile.write(b"s")
                self.wfile.flush()
                time.sleep(30)
                return
            if path.startswith("/bytes/"):
                size = int(path.rsplit("/", 1)[1])
                self.send_response(200)
                self.send_header("Content-Length", str(size))
                self.end_headers()
                block = b"b" * 65536
                left = size
                try:
                    while left > 0:
                        self.wfile.write(block[:min(left, len(block))])
                        left -= min(left, len(block))
                except (BrokenPipeError, ConnectionResetError):
                    pass  # a client that stopped reading, as a size limit does
                return
            text = f"{up.name} {self.command} {self.path}".encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(text)))
            self.end_headers()
            self.wfile.write(text)

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _serve

    up.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    up.server.daemon_threads = True
    threading.Thread(target=up.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    return up


def stop(up: Upstream) -> None:
    up.server.shutdown()
    up.server.server_close()
