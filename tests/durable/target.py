"""A small real HTTP service for the durable tests: applies each idempotency key once and remembers every call.

It runs on 127.0.0.1 in a thread of the test process; ``flaky`` makes the first call of some keys fail with 503.
"""

from __future__ import annotations

import json
import random
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable


class ChargeTarget:
    """POST /charge {"amount": n} with an Idempotency-Key header; the first call per key is applied."""

    def __init__(self, flaky: float = 0.0, seed: int = 1) -> None:
        self.seen: Counter[str] = Counter()
        self.applied: dict[str, dict[str, Any]] = {}
        self.balance = 0
        self.rejected_keys: set[str] = set()
        self._flaky = flaky
        self._rng = random.Random(seed)
        #: Called with a key just applied, before the response leaves (a test's hook to kill the caller there).
        self.on_applied: Callable[[str], None] | None = None
        self._lock = threading.Lock()
        target = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server naming)
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                code, out = target.handle(self.headers.get("Idempotency-Key"), body)
                data = json.dumps(out).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def handle(self, key: str | None, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if not key:
            return 400, {"error": "Idempotency-Key header required"}
        with self._lock:
            self.seen[key] += 1
            if key in self.applied:
                return 200, self.applied[key]  # a repeat: same answer, nothing applied again
            if self.seen[key] == 1 and self._rng.random() < self._flaky:
                self.rejected_keys.add(key)
                return 503, {"error": "try again"}
            self.balance += int(body["amount"])
            out = self.applied[key] = {"receipt": len(self.applied) + 1, "amount": int(body["amount"])}
        hook = self.on_applied
        if hook is not None:
            hook(key)
        return 200, out

    def __enter__(self) -> "ChargeTarget":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
