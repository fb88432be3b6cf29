"""A `moorage up` host in a fleet (PostgreSQL, an S3 object store) shows its heartbeat's age against its lease
TTL on ``/metrics``: the figure to alert on before its instances are taken over."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.fleet.harness import Fleet, replied
from tests.objects.conftest import s3_bucket, seaweedfs  # noqa: F401 - fixtures, found by name

pytestmark = pytest.mark.timeout(300)


def test_a_fleet_host_shows_its_heartbeat_age_and_lease_ttl(tmp_path: Path, pg_url: str, seaweedfs,  # noqa: ANN001, F811
                                                          s3_bucket: str) -> None:  # noqa: F811
    f = Fleet(tmp_path, pg_url, seaweedfs.settings(s3_bucket, f"fleet-{tmp_path.name}"), n=1)
    try:
        f.deploy()
        assert replied(f.turn(0, "ada"))
        token = (f.hosts[0].data / "api" / "metrics-token").read_text().strip()
        text = f.hosts[0].client(token).get("/metrics").text
        age = float(re.search(r"^moorage_fleet_heartbeat_age_seconds (\S+)$", text, re.M).group(1))
        ttl = float(re.search(r"^moorage_fleet_lease_ttl_seconds (\S+)$", text, re.M).group(1))
        assert ttl == 4.0 and 0 <= age < ttl, (age, ttl)  # the harness beats every second, leases last 4 s
    finally:
        f.close()
