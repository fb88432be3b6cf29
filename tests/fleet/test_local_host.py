"""The harness's `moorage up` (``devservices.fleet.LocalHost``, which fleet tests and benches start) on a port
another process took first: that process answered /healthz, so the harness took it for the host and the test's
requests got 401s from it, while the host had stopped on "cannot listen". Now it waits for the host's own record
(its pid) and starts it again on another port."""

from __future__ import annotations

from pathlib import Path

import pytest

from moorage.devservices import fleet as harness
from moorage.devservices.postgres import free_port
from tests.upproc import squatter


def test_a_port_taken_first_is_given_up_for_another(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with squatter() as taken:
        ports = iter([taken])
        monkeypatch.setattr(harness, "free_port", lambda: next(ports, None) or free_port())
        host = harness.LocalHost("box", tmp_path / "data", {"MOORAGE_LOG_LEVEL": "warning"}, start_timeout_s=120)
        try:
            assert host.port != taken and host.url.endswith(f":{host.port}")
            with host.client(host.key) as c:
                assert c.get("/v1/agents").status_code == 200  # this host, with its own key
            assert f"cannot listen on 127.0.0.1:{taken}" in host.log.read_text()  # the first try, said in its log
        finally:
            host.stop()
