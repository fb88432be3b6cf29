"""The egress policy's conformance suite: one table of requests, run against every place that enforces it.

Enforcers: the decision itself (resolve → decide), ``ctx.fetch``'s client, and the gateway's HTTP proxy.
An enforcer passes when it admits exactly the allowed rows (and the upstream sees them) and refuses the
others before anything reaches any upstream. A new enforcer is added to ``ENFORCERS`` and must pass as is.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

import pytest

from moorage.egress import Egress, EgressDenied, Gateway, Target, fetch
from tests.egress.conftest import rules_for
from tests.egress.servers import Upstream

ALLOWED = [
    ("exact host", "http://api.test:{A}/hello", "/hello"),
    ("host case and trailing dot", "http://API.Test.:{A}/hello", "/hello"),
    ("query string", "http://api.test:{A}/q?x=1", "/q?x=1"),
    ("path under the prefix", "http://paths.test:{A}/v1/items", "/v1/items"),
    ("path equal to the prefix", "http://paths.test:{A}/v1", "/v1"),
    ("wildcard subdomain", "http://a.wild.test:{A}/", "/"),
    ("deeper wildcard subdomain", "http://a.b.wild.test:{A}/x", "/x"),
]

DENIED = [
    ("userinfo: allowed host as user name", "http://api.test:{A}@evil.test:{B}/"),
    ("userinfo with a password", "http://api.test:pw@evil.test:{A}/"),
    ("suffix: allowed host as a prefix of another name", "http://api.test.evil.test:{A}/"),
    ("dot-dot escape from a path prefix", "http://paths.test:{A}/v1/../admin"),
    ("encoded dot-dot escape", "http://paths.test:{A}/v1/%2e%2E/admin"),
    ("single-dot segment", "http://paths.test:{A}/v1/./x"),
    ("encoded slash under a path rule", "http://paths.test:{A}/v1%2f..%2fadmin"),
    ("sibling of the path prefix", "http://paths.test:{A}/v1-admin"),
    ("path outside the prefix", "http://paths.test:{A}/admin"),
    ("allowed host on another port", "http://api.test:{B}/"),
    ("IP literal of an allowed name", "http://127.0.0.1:{A}/"),
    ("internal service on loopback", "http://127.0.0.1:{B}/"),
    ("unlisted name resolving to loopback", "http://evil.test:{A}/"),
    ("wildcard does not cover its apex", "http://wild.test:{A}/"),
    ("wildcard look-alike", "http://evilwild.test:{A}/"),
    ("scheme not allowed", "ftp://api.test:{A}/"),
    ("IPv6 loopback literal", "http://[::1]:{A}/"),
    ("IPv4-mapped IPv6 loopback literal", "http://[::ffff:127.0.0.1]:{A}/"),
    ("name resolving to IPv6 loopback", "http://v6.test:{A}/"),
    ("backslash", "http://api.test:{A}\\@evil.test/"),
    ("zero port", "http://api.test:0/"),
]

Request = Callable[[str], Awaitable[bool]]


async def _decision(egress: Egress, allow: list[str], gateway: Gateway) -> Request:
    policy = egress.policy_for({"egress": {"allow": allow}})

    async def request(url: str) -> bool:
        try:
            t = Target.parse(url)
        except EgressDenied:
            return False
        return (await egress.check(policy, t)).allowed

    return request


async def _fetch(egress: Egress, allow: list[str], gateway: Gateway) -> Request:
    inst = egress.instance({"egress": {"allow": allow}})

    async def request(url: str) -> bool:
        try:
            r = await fetch(inst, "GET", url, timeout_s=10)
        except EgressDenied:
            return False
        assert r.status == 200, r
        return True

    return request


async def _proxy(egress: Egress, allow: list[str], gateway: Gateway) -> Request:
    binding = await gateway.bind("conformance", egress.instance({"egress": {"allow": allow}}), dns=False)

    async def request(url: str) -> bool:
        reader, writer = await asyncio.open_connection("127.0.0.1", binding.proxy_port)
        writer.write(f"GET {url} HTTP/1.1\r\nHost: ignored\r\n\r\n".encode())
        await writer.drain()
        head = await asyncio.wait_for(reader.read(65536), 10)
        writer.close()
        status = int(head.split(b" ", 2)[1])
        assert status in (200, 400, 403), head[:200]
        return status == 200

    return request


ENFORCERS = {"decision": _decision, "fetch": _fetch, "proxy": _proxy}


@pytest.fixture(params=sorted(ENFORCERS))
async def enforcer(request: pytest.FixtureRequest, egress: Egress, upstream: Upstream, outside: Upstream):
    gateway = Gateway(egress)
    allow = rules_for(upstream.port) + [f"http://v6.test:{upstream.port}"]
    req = await ENFORCERS[request.param](egress, allow, gateway)
    yield request.param, req
    await gateway.close()


def _url(template: str, upstream: Upstream, outside: Upstream) -> str:
    return template.replace("{A}", str(upstream.port)).replace("{B}", str(outside.port))


@pytest.mark.parametrize("case", ALLOWED, ids=[c[0] for c in ALLOWED])
async def test_allowed_requests_reach_the_upstream(enforcer, case, upstream: Upstream, outside: Upstream) -> None:
    name, req = enforcer
    _, template, path = case
    assert await req(_url(template, upstream, outside)) is True
    if name != "decision":
        assert upstream.paths() == [path]
    assert outside.hits == []


@pytest.mark.parametrize("case", DENIED, ids=[c[0] for c in DENIED])
async def test_denied_requests_reach_nothing(enforcer, case, upstream: Upstream, outside: Upstream) -> None:
    _, req = enforcer
    assert await req(_url(case[1], upstream, outside)) is False
    assert upstream.hits == [] and outside.hits == []
