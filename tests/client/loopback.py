"""A loopback HTTP server for the SDK tests: a test gives what to do with each request; the server runs it on a
thread per request and closes when the test is done. Only loopback addresses are ever served (127.0.0.1 unless a
test names another, such as 127.0.0.2 standing in for another machine)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Mapping

Respond = Callable[[BaseHTTPRequestHandler], None]


def reply(handler: BaseHTTPRequestHandler, status: int, body: bytes = b"",
          headers: Mapping[str, str] | None = None) -> None:
    """Answer with ``status``, ``body`` and ``headers`` (content-length added)."""
    handler.send_response(status)
    for k, v in (headers or {}).items():
        handler.send_header(k, v)
    handler.send_header("content-length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def read_body(handler: BaseHTTPRequestHandler) -> bytes:
    return handler.rfile.read(int(handler.headers.get("content-length") or 0))


class Loopback:
    """Serves every method with ``respond(handler)``; ``url`` is where; usable as a context manager."""

    def __init__(self, respond: Respond, http11: bool = False, host: str = "127.0.0.1") -> None:
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1" if http11 else "HTTP/1.0"

            def _any(self) -> None:
                respond(self)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _any

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.url = f"http://{host}:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> "Loopback":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
