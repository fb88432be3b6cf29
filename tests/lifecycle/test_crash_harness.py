"""The crash tests' harness itself: a host that could not take its port is not mistaken for the one that did."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tests.lifecycle.crash_up import Up


def test_a_port_another_server_took_first_is_given_up_for_another(tmp_path: Path) -> None:
    """Two workers picked one free port: the other one's host listened first, answered /healthz, and the test's
    requests reached it with a key it does not know (401), while this host had exited on 'address in use'."""

    class Healthy(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    squatter = ThreadingHTTPServer(("127.0.0.1", 0), Healthy)
    threading.Thread(target=squatter.serve_forever, daemon=True).start()
    taken = squatter.server_address[1]
    up = Up(tmp_path / "data", taken)
    try:
        up.start()
        assert up.port != taken
        with up.client() as c:
            assert c.get("/v1/agents").status_code == 200  # this host, with its own key
    finally:
        up.stop()
        squatter.shutdown()
