"""Egress test fixtures: two loopback upstreams (one the policy allows, one it does not), a test resolver
that maps made-up names into 127.0.0.0/8, and an operator policy that admits 127.0.0.0/8 explicitly.
"""

from __future__ import annotations

from typing import Iterator

import pytest

from moorage.egress import AddressPolicy, Egress, Limits, OperatorPolicy, StaticResolver
from tests.egress.servers import Upstream, start_upstream, stop

#: Names the test resolver knows; every one of them points into loopback except those the decision tests use.
NAMES = {
    "api.test": ["127.0.0.1"],
    "paths.test": ["127.0.0.1"],
    "evil.test": ["127.0.0.1"],
    "api.test.evil.test": ["127.0.0.1"],
    "a.wild.test": ["127.0.0.1"],
    "a.b.wild.test": ["127.0.0.1"],
    "wild.test": ["127.0.0.1"],
    "evilwild.test": ["127.0.0.1"],
    "secret.test": ["127.0.0.2"],
    "v6.test": ["::1"],
}

#: The operator policy of these tests: loopback IPv4 is "the internet" (IPv6 loopback stays refused).
TEST_OPERATOR = OperatorPolicy(AddressPolicy.of(False, "127.0.0.0/8"), limits=Limits(connects_per_s=1000))


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    up = start_upstream("A")
    yield up
    stop(up)


@pytest.fixture
def outside() -> Iterator[Upstream]:
    """A loopback server no rule names: what "an internal service" is in these tests."""
    up = start_upstream("B")
    yield up
    stop(up)


@pytest.fixture
def egress() -> Egress:
    return Egress(TEST_OPERATOR, StaticResolver(NAMES))


def rules_for(port: int) -> list[str]:
    """The agent's [agent.egress] allow list used by the conformance suite."""
    return [
        f"http://api.test:{port}",
        f"http://paths.test:{port}/v1",
        f"http://*.wild.test:{port}",
        f"https://api.test:{port}",
    ]
