"""docs/api.md's Routes table against the server's routing table: every route the server has is a row, every row a
route, and each row's "who" column says the scope its `Endpoint` declares (the one the wrapper enforces), with
"end-user token" exactly where such a token may call it. A route added, removed or given another scope without its
row fails here."""

from __future__ import annotations

import re
from pathlib import Path

from moorage.api.routes import all_endpoints

API_MD = Path(__file__).resolve().parents[2] / "docs" / "api.md"
#: What the table says for the routes that take no tenant key.
NOT_TENANT = {"operator": "operator token", "none": "public"}
#: Served outside the routing table (the app's own routes).
OUTSIDE = {("GET", "/openapi.json"): "public", ("GET", "/metrics"): "operator or metrics token"}


def _rows() -> dict[tuple[str, str], str]:
    table = API_MD.read_text().split("\n## Routes\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for m in re.finditer(r"^\| `([A-Z\\|]+) (\S+)` \| ([^|]+) \|", table, flags=re.M):
        for method in m.group(1).replace("\\", "").split("|"):
            rows[(method, m.group(2))] = m.group(3).strip()
    assert len(rows) > 80, len(rows)
    return rows


def _who(e) -> str:  # noqa: ANN001 - an Endpoint
    if e.auth != "tenant":
        return NOT_TENANT[e.auth]
    scopes = [e.scope or "admin", *e.also_scopes]
    return " or ".join(scopes) + (" · end-user token" if e.end_user else "")


def _same(documented: str, declared: str) -> bool:
    """``read or provision`` is ``provision or read``; ``public (the link's token)`` is ``public``."""
    def words(s: str) -> tuple[frozenset[str], bool]:
        head, _, tail = s.partition(" · ")
        return frozenset(head.split(" (", 1)[0].split(" or ")), "end-user token" in tail
    return words(documented) == words(declared)


def test_every_route_has_its_row_with_the_scope_it_declares() -> None:
    rows = _rows()
    served: dict[tuple[str, str], str] = dict(OUTSIDE)
    for e in all_endpoints():
        path = re.sub(r"{([^}:]+):[^}]*}", r"{\1}", e.path)  # {path:path} is {path} in the table
        served[(e.method, path)] = _who(e)
    assert sorted(set(served) - set(rows)) == [], "routes the table of docs/api.md does not list"
    assert sorted(set(rows) - set(served)) == [], "rows of docs/api.md's table the server has no route for"
    # GET /v1/whoami: any key or token ("any"), whatever its scopes.
    wrong = [f"{m} {p}: the table says {rows[(m, p)]!r}, the route declares {who!r}" for (m, p), who in served.items()
             if not _same(rows[(m, p)], who) and not (p == "/v1/whoami" and rows[(m, p)] == "any")]
    assert wrong == []


def test_the_check_sees_a_wrong_scope() -> None:
    assert _same("read or provision", "provision or read")
    assert _same("public (the link's token)", "public")
    assert not _same("read", "read · end-user token")
    assert not _same("deploy", "invoke")
