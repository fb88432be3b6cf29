"""``ctx.fetch``'s client on the host: redirects, DNS answers into loopback, no re-resolution, body caps and
deadlines, secret headers, generic errors. Upstreams are loopback servers the test starts."""

from __future__ import annotations

import ipaddress
import socket
import tracemalloc

import pytest

from moorage.egress import (Egress, EgressDenied, EgressFailed, OperatorPolicy, StaticResolver, Target, fetch)
from tests.egress.conftest import NAMES, TEST_OPERATOR
from tests.egress.servers import MIB, Upstream


def _inst(egress: Egress, *allow: str, headers=None, spans: list | None = None):  # type: ignore[no-untyped-def]
    record = (lambda started, status, attrs: spans.append((status, attrs))) if spans is not None else None
    return egress.instance({"egress": {"allow": list(allow)}}, record=record, headers=headers)


async def test_a_redirect_to_a_denied_host_is_not_followed(egress: Egress, upstream: Upstream, outside: Upstream) -> None:
    upstream.redirects["/go"] = (302, f"{outside.base}/internal")
    spans: list = []
    with pytest.raises(EgressDenied, match="redirected"):
        await fetch(_inst(egress, f"http://api.test:{upstream.port}", spans=spans), "GET", f"http://api.test:{upstream.port}/go")
    assert upstream.paths() == ["/go"] and outside.hits == []
    assert [s for s, _ in spans] == ["ok", "denied"] and spans[1][1]["egress.redirect"] is True


async def test_redirects_to_allowed_targets_are_followed_without_carrying_credentials_across_origins(
        egress: Egress, upstream: Upstream) -> None:
    A = upstream.port
    upstream.redirects["/start"] = (301, f"http://a.wild.test:{A}/next")
    upstream.redirects["/next"] = (303, "/final")
    r = await fetch(_inst(egress, f"http://api.test:{A}", f"http://*.wild.test:{A}"), "POST",
                    f"http://api.test:{A}/start", headers={"Authorization": "mine", "X-Other": "kept"}, body=b"{}")
    assert r.status == 200 and r.url == f"http://a.wild.test:{A}/final" and len(r.redirects) == 2
    first, second, third = upstream.hits
    assert first.headers["authorization"] == "mine" and first.method == "POST"
    assert "authorization" not in second.headers and second.headers["x-other"] == "kept"
    assert second.method == "GET"  # a POST answered with 301 becomes a GET, like browsers do


async def test_a_name_that_resolves_to_loopback_is_refused_by_default(upstream: Upstream) -> None:
    eg = Egress(OperatorPolicy(), StaticResolver({"innocent.test": ["127.0.0.1"]}))
    with pytest.raises(EgressDenied, match="loopback"):
        await fetch(_inst(eg, f"http://innocent.test:{upstream.port}"), "GET", f"http://innocent.test:{upstream.port}/")
    assert upstream.hits == []


async def test_the_connection_goes_to_the_address_that_was_judged(upstream: Upstream) -> None:
    class Rebinding:
        """First answer: loopback where the upstream listens. Any later answer: an address where nothing does."""

        calls = 0

        async def resolve(self, host: str, owner: str = "") -> list:
            self.calls += 1
            return [ipaddress.ip_address("127.0.0.1" if self.calls == 1 else "127.0.0.3")]

    resolver = Rebinding()
    eg = Egress(TEST_OPERATOR, resolver)
    r = await fetch(_inst(eg, f"http://flip.test:{upstream.port}"), "GET", f"http://flip.test:{upstream.port}/x")
    assert r.status == 200 and upstream.paths() == ["/x"] and resolver.calls == 1


async def test_an_endless_body_is_cut_at_the_cap_with_memory_flat(egress: Egress, upstream: Upstream) -> None:
    inst = _inst(egress, f"http://api.test:{upstream.port}")
    tracemalloc.start()
    try:
        r = await fetch(inst, "GET", f"http://api.test:{upstream.port}/endless", max_body=MIB, timeout_s=60)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert r.truncated and len(r.body) == MIB
    assert peak < 8 * MIB, peak  # the cap bounds what is held, not the upstream


async def test_a_total_deadline_ends_a_stalled_body(egress: Egress, upstream: Upstream) -> None:
    with pytest.raises(EgressFailed, match="did not finish within 1s"):
        await fetch(_inst(egress, f"http://api.test:{upstream.port}"), "GET", f"http://api.test:{upstream.port}/slow",
                    timeout_s=1)


async def test_connection_errors_reach_the_caller_as_a_generic_error(egress: Egress) -> None:
    with socket.socket() as s:  # a loopback port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(EgressFailed) as e:
        await fetch(_inst(egress, f"http://api.test:{port}"), "GET", f"http://api.test:{port}/")
    text = str(e.value)
    assert "refused" not in text.lower() and "errno" not in text.lower() and "127.0.0.1" not in text


async def test_bound_headers_replace_the_guests_own(egress: Egress, upstream: Upstream) -> None:
    async def headers(t: Target) -> dict[str, str]:
        return {"Authorization": "Bearer host-side"} if t.host == "api.test" else {}

    spans: list = []
    r = await fetch(_inst(egress, f"http://api.test:{upstream.port}", headers=headers, spans=spans), "GET",
                    f"http://api.test:{upstream.port}/h", headers={"authorization": "guest", "Host": "evil.test"})
    assert r.status == 200
    assert upstream.hits[0].headers["authorization"] == "Bearer host-side"
    assert upstream.hits[0].headers["host"] == f"api.test:{upstream.port}"
    assert "host-side" not in repr(spans) and spans[0][1]["egress.secrets"] == 1


async def test_unsupported_methods_are_refused(egress: Egress, upstream: Upstream) -> None:
    with pytest.raises(EgressDenied, match="method"):
        await fetch(_inst(egress, f"http://api.test:{upstream.port}"), "CONNECT", f"http://api.test:{upstream.port}/")


def test_names_used_here_stay_in_loopback() -> None:
    assert all(a.startswith("127.") or a == "::1" for v in NAMES.values() for a in v)


async def test_bound_headers_follow_the_binding_not_the_redirect(egress: Egress, upstream: Upstream) -> None:
    async def headers(t: Target) -> dict[str, str]:
        return {"Authorization": "Bearer bound-to-api"} if t.host == "api.test" else {}

    A = upstream.port
    upstream.redirects["/away"] = (302, f"http://a.wild.test:{A}/landed")
    r = await fetch(_inst(egress, f"http://api.test:{A}", f"http://*.wild.test:{A}", headers=headers), "GET",
                    f"http://api.test:{A}/away")
    assert r.status == 200 and upstream.paths() == ["/away", "/landed"]
    assert upstream.hits[0].headers["authorization"] == "Bearer bound-to-api"
    assert "authorization" not in upstream.hits[1].headers  # the redirect's target is not a bound host
