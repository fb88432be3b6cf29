"""`cors_origins`: the named browser origins get CORS answers (a preflight, then the real request readable by the
page), every other origin and every request without one is served as before, and an agent's app keeps answering its
own preflights. A value that is not an origin stops the host at start."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import pytest

from moorage.api import create_app
from moorage.config import Config, load
from moorage.errors import ConfigError
from moorage.store import Store
from tests.api.conftest import serve

PAGE = "http://127.0.0.1:8002"


@pytest.fixture
def server(tmp_path: Path, store: Store) -> Iterator[str]:
    app = create_app(store, Config(data_dir=tmp_path / "data", cors_origins=f"{PAGE}, https://app.example.com"))
    srv, thread, url = serve(app)
    try:
        yield url
    finally:
        srv.should_exit = True
        thread.join(timeout=30)


def _preflight(url: str, path: str, origin: str) -> httpx.Response:
    return httpx.options(url + path, timeout=30, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type,idempotency-key"})


def test_named_origins_get_cors_answers_and_others_are_served_as_before(server: str, store: Store) -> None:
    key = store.operator.create_tenant("acme")[1].secret
    ok = _preflight(server, "/v1/agents/notes/invoke", PAGE)
    assert ok.status_code == 200, ok.text
    assert ok.headers["access-control-allow-origin"] == PAGE
    assert "POST" in ok.headers["access-control-allow-methods"]
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    assert "access-control-allow-credentials" not in ok.headers  # no cookie opens the API

    # The request itself: readable by the page, with the headers it needs (the trace id, Retry-After).
    me = httpx.get(server + "/v1/whoami", headers={"Origin": "https://app.example.com",
                                                   "Authorization": f"Bearer {key}"}, timeout=30)
    assert me.status_code == 200 and me.headers["access-control-allow-origin"] == "https://app.example.com"
    assert "x-trace-id" in me.headers["access-control-expose-headers"]
    refused = httpx.get(server + "/v1/whoami", headers={"Origin": PAGE}, timeout=30)  # errors too, or the page
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == PAGE  # cannot read why

    # Any other origin, or none: no CORS answer, the route's own (a preflight is the 405 it always was).
    for origin in ("https://evil.example", "null", None):
        r = _preflight(server, "/v1/agents/notes/invoke", origin) if origin else httpx.options(
            server + "/v1/agents/notes/invoke", timeout=30)
        assert r.status_code == 405 and "access-control-allow-origin" not in r.headers, (origin, r.headers)
    # An agent's app answers its own preflights (docs/app.md), a named origin's too.
    app = _preflight(server, "/v1/agents/notes/users/ada/app/x", PAGE)
    assert "access-control-allow-origin" not in app.headers and app.status_code != 200, app.headers


@pytest.mark.parametrize("value", ["*", "null", "https://app.example.com/path", "app.example.com"])
def test_a_value_that_is_not_an_origin_stops_the_host_at_start(value: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load(env={"MOORAGE_CORS_ORIGINS": f"http://127.0.0.1:8002,{value}", "MOORAGE_DATA_DIR": str(tmp_path)})
    assert repr(value) in str(e.value) and "e.g. https://app.example.com" in (e.value.hint or ""), e.value
