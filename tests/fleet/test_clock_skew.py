"""Two `moorage up` hosts on one PostgreSQL whose clocks differ by 40 s (one runs under libfaketime): leases,
claims and forwarding signatures run on the store's clock, so neither host takes the other for dead, each
user stays on the host that holds it and requests through the other host are forwarded there."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from moorage.devservices.fleet import LocalHost
from tests.fleet.harness import Fleet, replied

LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
SKEW_S = 40.0
LEASE_TTL_S = 4.0  # the harness's


@pytest.fixture
def s3(seaweedfs, s3_bucket, tmp_path: Path) -> dict[str, str]:  # noqa: ANN001
    return seaweedfs.settings(s3_bucket, f"fleet-{tmp_path.name}")


def test_hosts_whose_clocks_differ_keep_their_users_and_forward_to_each_other(tmp_path: Path, pg_url: str,
                                                                              s3: dict[str, str]) -> None:
    assert LIBFAKETIME.exists(), "libfaketime (Debian package) is installed by scripts/bootstrap.sh"
    f = Fleet(tmp_path, pg_url, s3, n=1)
    try:
        f.deploy()
        behind = {**f.env, "LD_PRELOAD": str(LIBFAKETIME), "FAKETIME": f"-{SKEW_S:.0f}s",
                  "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
        f.hosts.append(LocalHost("h2", tmp_path / "h2", behind, start_timeout_s=120))
        f.api.append(f.hosts[1].client(f.key))

        assert replied(f.turn(1, "ada")) and f.records()["ada"].host == "h2"
        assert replied(f.turn(0, "bob")) and f.records()["bob"].host == "h1"
        epochs = {u: r.lease_epoch for u, r in f.records().items()}
        time.sleep(LEASE_TTL_S + 3)  # heartbeats 40 s old on h2's own clock would have lapsed by now

        rows = {h.id: h for h in f.host_rows()}
        assert rows["h2"].alive(LEASE_TTL_S), f"h2's heartbeat is {time.time() - rows['h2'].heartbeat_at:.1f} s old"
        for i, user, owner in ((0, "ada", "h2"), (1, "bob", "h1")):
            r = f.turn(i, user)
            assert replied(r) and r.headers.get("x-moorage-served-by") == owner, (user, dict(r.headers))
            assert f.records()[user].host == owner and f.records()[user].lease_epoch == epochs[user], f.records()[user]

        operator = (f.hosts[1].data / "api" / "operator-token").read_text().strip()
        text = f.hosts[1].client(operator).get("/metrics").text
        offset = float(re.search(r"^moorage_clock_offset_seconds (\S+)$", text, re.M).group(1))
        assert SKEW_S - 2 < offset < SKEW_S + 2, offset
        assert "this host's clock is off the store's" in f.hosts[1].log.read_text()
        assert "this host's clock is off" not in f.hosts[0].log.read_text()
    finally:
        f.close()
