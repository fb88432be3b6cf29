"""A hostile tenant goes after ``/metrics``: it reads it without the operator's credentials, and invents
HTTP methods to grow its series without bound. Neither works, and scrapes stay cheap however frequent.
"""

from __future__ import annotations

import re
import socket
from urllib.parse import urlsplit

from moorage.api.app import _instance_counts
from moorage.observability.metrics import KNOWN_METHODS, Metrics
from moorage.store import Scope, Store
from tests.api.conftest import LiveServer
from tests.attacks.api_support import server, sqlite_store, tenant_key  # noqa: F401 - fixtures, found by name

INVENTED = 300


def _metrics_token(server: LiveServer) -> str:
    return (server.data_dir / "api" / "metrics-token").read_text().strip()


def test_metrics_need_the_metrics_or_operator_token(server: LiveServer, tenant_key: str) -> None:
    with server.client() as c:
        assert c.get("/metrics").status_code == 401
        assert c.get("/metrics", headers={"Authorization": f"Bearer {tenant_key}"}).status_code == 401
        assert c.get("/metrics", headers={"Authorization": "Bearer not-the-token"}).status_code == 401
        for token in (_metrics_token(server), server.operator_token):
            r = c.get("/metrics", headers={"Authorization": f"Bearer {token}"})
            assert r.status_code == 200 and "moorage_http_requests_total" in r.text
    # The metrics token is good for nothing else.
    with server.client(_metrics_token(server)) as c:
        assert c.get("/v1/agents").status_code == 401
        assert c.post("/v1/tenants", json={"name": "x"}).status_code == 401


def _raw_request(url: str, method: str) -> None:
    u = urlsplit(url)
    with socket.create_connection((u.hostname, u.port)) as s:
        s.sendall(f"{method} /v1/agents HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        while s.recv(65536):
            pass


#: Methods an HTTP parser lets through to the app (llhttp knows these) though the API serves none of them.
UNSERVED = ["PROPFIND", "PROPPATCH", "MKCOL", "COPY", "MOVE", "LOCK", "UNLOCK", "SEARCH", "PURGE", "REPORT", "TRACE",
            "LINK", "UNLINK", "MKCALENDAR", "SUBSCRIBE", "NOTIFY", "ACL", "BIND", "REBIND", "UNBIND", "SOURCE"]


def test_invented_methods_do_not_grow_the_series(server: LiveServer, tenant_key: str) -> None:
    for i in range(INVENTED):
        # Every other one is a made-up token (h11 passes those on; llhttp refuses them before the app).
        _raw_request(server.url, UNSERVED[i % len(UNSERVED)] if i % 2 else f"X{i}BREW")
    with server.client(_metrics_token(server)) as c:
        text = c.get("/metrics").text
    methods = set(re.findall(r'moorage_http_requests_total\{method="([^"]*)"', text))
    assert methods <= KNOWN_METHODS | {"other"}, methods
    assert "other" in methods, "no unserved method reached the app; the test proves nothing"
    assert "BREW" not in text and "PROPFIND" not in text
    series = [ln for ln in text.splitlines() if ln.startswith("moorage_http_requests_total{")]
    assert len(series) < 10, series


def test_instance_gauge_is_counted_in_the_store_and_cached_between_scrapes(sqlite_store: Store) -> None:
    ts = sqlite_store.tenant(sqlite_store.authenticate(sqlite_store.operator.create_tenant("big")[1].secret))
    for i in range(300):
        ts.sandboxes.create(Scope.for_user("a", f"u{i}"), state="sleeping" if i % 3 else "running")
    calls = 0
    count = _instance_counts(sqlite_store)

    def counted() -> dict[str, int]:
        nonlocal calls
        calls += 1
        return dict(count())

    metrics = Metrics(counted, instance_ttl_s=3600)
    for _ in range(50):
        text = metrics.render().decode()
    assert calls == 1, "every scrape recounted the instances"
    assert 'moorage_instances{state="sleeping"} 200.0' in text and 'moorage_instances{state="running"} 100.0' in text
    fresh = Metrics(counted, instance_ttl_s=0)
    fresh.render()
    fresh.render()
    assert calls == 3
