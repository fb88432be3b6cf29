"""The markers one host of a fleet sets on a request it sends another (``x-moorage-forwarded-by``, ``x-moorage-let-go``,
the forwarded ``traceparent``) count only with that host's signature: a tenant's caller that sets them itself is an
ordinary client (its forget forgets, its request is forwarded like any other, its trace id is not kept), and a
signature older than a minute is refused. Genuine forwarding is covered by test_forward.py and test_forget_fleet*.py.
"""

from __future__ import annotations

import secrets
import time
from typing import Iterator

import httpx
import pytest

from moorage.fleet.forward import FORWARD_AUTH, FORWARDED_BY, LET_GO, ForwardSigner
from moorage.secrets.keyring import _encode, new_key
from tests.fleet.harness import Fleet, replied

pytestmark = pytest.mark.timeout(600)

OLD_KEY, NEW_KEY = new_key(), new_key()  # the hosts sign with the first and accept both (a rotation)
USERS = ("ada", "bo", "cy", "dee")  # one per test, each awake on h1


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, pg_cluster, seaweedfs, s3_bucket) -> Iterator[Fleet]:  # noqa: ANN001
    base = tmp_path_factory.mktemp("fwauth")
    f = Fleet(base, pg_cluster.create_database("fwauth"), seaweedfs.settings(s3_bucket, f"fleet-{base.name}"), n=2,
              secrets_keys=f"{_encode(*NEW_KEY)},{_encode(*OLD_KEY)}")
    try:
        f.deploy()
        for user in USERS:  # awake on h1: h2 forwards to it
            assert replied(f.turn(0, user)) == "1: hi"
        assert {f.records()[u].host for u in USERS} == {"h1"}
        yield f
    finally:
        f.close()


def _trace() -> tuple[str, str]:
    tid = secrets.token_hex(16)
    return tid, f"00-{tid}-{secrets.token_hex(8)}-01"


def test_a_callers_own_forwarded_marker_keeps_no_trace_id(fleet: Fleet) -> None:
    tid, tp = _trace()
    r = fleet.api[0].get("/v1/agents/echo/users/ada", headers={FORWARDED_BY: "h2", "traceparent": tp})
    assert r.status_code == 200, r.text
    assert r.headers["x-trace-id"] != tid  # the caller's own traceparent is not taken as a host's


def test_a_callers_own_forwarded_marker_does_not_stop_the_forward(fleet: Fleet) -> None:
    # Through h2, which does not hold ada: a marked request used to be refused as "moved again" (one hop).
    r = fleet.api[1].post("/v1/agents/echo/invoke", json={"message": "hi", "user": "bo"},
                          headers={FORWARDED_BY: "h1"})
    assert r.status_code == 200 and r.headers["x-moorage-served-by"] == "h1", r.text
    assert r.json()["reply"] == "2: hi"


def test_a_callers_own_let_go_is_an_ordinary_forget(fleet: Fleet) -> None:
    # Used to: h1 cancelled cy's turns and slept the instance, and answered deleted: false (cy kept).
    r = fleet.api[0].delete("/v1/agents/echo/users/cy", headers={FORWARDED_BY: "h2", LET_GO: "1"})
    assert r.status_code == 200 and r.json()["deleted"] is True, r.text
    assert fleet.api[0].get("/v1/agents/echo/users/cy").status_code == 404
    assert "cy" not in fleet.records()


def _signed(fleet: Fleet, signer: ForwardSigner, path: str, tp: str, *, now: float | None = None,
            signed_path: str | None = None) -> httpx.Response:
    auth = signer.sign("h2", "GET", signed_path or path, "", trace=tp, now=now)
    return fleet.api[0].get(path, headers={FORWARDED_BY: "h2", "traceparent": tp, FORWARD_AUTH: auth})


def test_a_host_signature_is_honoured_with_either_key_and_refused_when_old_altered_or_foreign(fleet: Fleet) -> None:
    path = "/v1/agents/echo/users/dee"
    for key in (NEW_KEY, OLD_KEY):  # the signing key and the one it replaced
        tid, tp = _trace()
        r = _signed(fleet, ForwardSigner((key,)), path, tp)
        assert r.status_code == 200 and r.headers["x-trace-id"] == tid, r.text
    signer = ForwardSigner((NEW_KEY,))
    tid, tp = _trace()
    assert _signed(fleet, signer, path, tp, now=time.time() - 120).headers["x-trace-id"] != tid  # replayed
    tid, tp = _trace()
    assert _signed(fleet, signer, path, tp, now=time.time() + 120).headers["x-trace-id"] != tid  # from the future
    tid, tp = _trace()
    r = _signed(fleet, signer, path, tp, signed_path="/v1/agents/echo/users/bob")  # another request's signature
    assert r.headers["x-trace-id"] != tid
    tid, tp = _trace()
    assert _signed(fleet, ForwardSigner((new_key(),)), path, tp).headers["x-trace-id"] != tid  # another installation
    # A replayed signature on a forget does not let go either: it is an ordinary forget.
    auth = signer.sign("h2", "DELETE", path, "", let_go="1", now=time.time() - 120)
    r = fleet.api[0].delete(path, headers={FORWARDED_BY: "h2", LET_GO: "1", FORWARD_AUTH: auth})
    assert r.status_code == 200 and r.json()["deleted"] is True, r.text
    assert fleet.api[0].get(path).status_code == 404

