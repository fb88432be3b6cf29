"""POST /v1/tenants with a name that is taken: a 409 whose hint says the tenant exists, not "re-read the record"."""

from __future__ import annotations


def test_a_duplicate_tenant_is_a_409_saying_the_name_is_taken(live) -> None:  # type: ignore[no-untyped-def]
    with live.client(live.operator_token) as c:
        assert c.post("/v1/tenants", json={"name": "initech"}).status_code == 201
        r = c.post("/v1/tenants", json={"name": "initech"})
    problem = r.json()
    assert r.status_code == 409 and "initech" in problem["detail"] and "already exists" in problem["detail"], problem
    assert "re-read" not in problem["hint"] and "choose another name" in problem["hint"], problem
