"""The crash tests' harness itself: a host that could not take its port is not mistaken for the one that did."""

from __future__ import annotations

from pathlib import Path

from tests.lifecycle.crash_up import Up
from tests.upproc import squatter


def test_a_port_another_server_took_first_is_given_up_for_another(tmp_path: Path) -> None:
    """Two workers picked one free port: the other one's host listened first, answered /healthz, and the test's
    requests reached it with a key it does not know (401), while this host had exited on 'address in use'."""
    with squatter() as taken:
        up = Up(tmp_path / "data", taken)
        try:
            up.start()
            assert up.port != taken
            with up.client() as c:
                assert c.get("/v1/agents").status_code == 200  # this host, with its own key
        finally:
            up.stop()
