"""``/metrics`` of a live host, read as someone writing alerts: every path a user's work takes shows in it, with
bounded labels."""

from __future__ import annotations

import pytest

from tests.observability.conftest import LiveHost, archive, value

pytestmark = pytest.mark.timeout(240)


async def test_scrapes_are_their_own_route_not_unmatched(live_host: LiveHost) -> None:
    async with live_host.client() as c:
        assert (await c.get("/openapi.json")).status_code == 200
    await live_host.scrape()
    samples = await live_host.scrape()
    assert value(samples, "moorage_http_requests_total", route="/metrics", method="GET", status="200") >= 1
    assert value(samples, "moorage_http_requests_total", route="/openapi.json", status="200") == 1
    assert value(samples, "moorage_http_requests_total", route="unmatched") == 0
