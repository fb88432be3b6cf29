"""The fleet tests use the object-store harness (local files and a real SeaweedFS S3 server) of tests/objects, and a
TCP relay in front of that server that a test can take down as an outage (tests/fleet/harness.py)."""

from typing import Iterator

import pytest

from tests.fleet.harness import Relay
from tests.objects.conftest import harness, object_store, s3_bucket, seaweedfs  # noqa: F401 - fixtures


@pytest.fixture(scope="module")
def relay(seaweedfs) -> Iterator[Relay]:  # noqa: ANN001, F811
    r = Relay(seaweedfs.s3_port)
    yield r
    r.close()
