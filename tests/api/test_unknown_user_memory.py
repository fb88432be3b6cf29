"""The memory listings that name one end-user (facts, the episodic log, a search of it) answer 404 for a user the
agent does not have, as the pending facts and the other per-user listings do (tests/api/test_unknown_user_listings.py),
instead of 200 with an empty list that reads as "this user remembers nothing". Another tenant's user of the same name
is unknown here; a user the agent has who has nothing yet gets 200 and an empty list, as does an end-user token's own
user. A share link is made for the users the link's app serves: registered, or with a session of the agent (opening
the link registers them, as their next turn would), not for a user the app would refuse."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from moorage.client import AsyncClient
from moorage.client.errors import NotFound
from moorage.store import Store
from tests.api.conftest import acme, aclient, agent_archive, globex, live_rt, runtime  # noqa: F401  (fixtures)

GZ = {"content-type": "application/gzip"}
LISTINGS = ("facts", "events", "events/search?q=hello")
HINT = "check the user id; GET /v1/agents/web/users lists them"


def _path(user: str, listing: str, agent: str = "web") -> str:
    return f"/v1/agents/{agent}/users/{user}/{listing}"


async def test_memory_listings_of_an_unknown_user_are_404(live_rt, acme: str, globex: str,  # noqa: F811
                                                          tmp_path: Path) -> None:
    # globex: agent "web" whose user ada talked to it (her log holds the turn) and has a fact.
    async with aclient(live_rt, globex) as g:
        assert (await g.post("/v1/agents/web/deployments", content=agent_archive(tmp_path, "web"),
                             headers=GZ)).status_code == 201
        assert (await g.post("/v1/agents/web/invoke", json={"message": "hello there", "user": "ada"})).status_code == 200
        r = await g.post(_path("ada", "facts"), json={"subject": "ada", "attribute": "city", "value": "Oslo"})
        assert r.status_code == 201, r.text
    # acme: an agent of the same name, with bea made (PUT) and nothing else.
    async with aclient(live_rt, acme) as a:
        assert (await a.post("/v1/agents/web/deployments", content=agent_archive(tmp_path, "web"),
                             headers=GZ)).status_code == 201
        assert (await a.put("/v1/agents/web/users/bea", json={})).status_code in (200, 201)
        for listing in LISTINGS:
            for user in ("ada", "nobody"):  # globex's ada is nobody here
                for path in (_path(user, listing), _path(user, listing) + ("&" if "?" in listing else "?") + "session=s1"):
                    r = await a.get(path)
                    assert r.status_code == 404, (path, r.text)
                    problem = r.json()
                    assert problem["type"].endswith("/not-found"), problem
                    assert problem["detail"] == f"agent 'web' has no user {user!r}", (path, problem)
                    assert problem["hint"] == HINT, problem
            r = await a.get(_path("bea", listing))  # a user who has nothing yet: an empty list
            assert r.status_code == 200 and r.json()["data"] == [], (listing, r.text)
            r = await a.get(_path("bea", listing, agent="nosuch"))  # an unknown agent stays the agent's 404
            assert r.status_code == 404 and "nosuch" in r.json()["detail"], (listing, r.text)
        # An end-user token names its own user, who may not have talked to the agent yet.
        token = (await a.post("/v1/agents/web/users/dan/tokens", json={})).json()["token"]
    async with aclient(live_rt, token) as end_user:
        for listing in LISTINGS:
            r = await end_user.get(_path("dan", listing))
            assert r.status_code == 200 and r.json()["data"] == [], (listing, r.text)
    # In globex ada is known: her listings answer with what she has, and a page past its end is empty, not a 404.
    async with aclient(live_rt, globex) as g:
        assert [f["value"] for f in (await g.get(_path("ada", "facts"))).json()["data"]] == ["Oslo"]
        assert (await g.get(_path("ada", "events?session=default"))).json()["data"], "ada's turn is in her log"
        assert (await g.get(_path("ada", "events/search?q=hello&session=default"))).json()["data"], "and recalled"
        for listing in ("facts?subject=nothing", "events", "events?session=s-none", "events/search?q=hello"):
            r = await g.get(_path("ada", listing))
            assert r.status_code == 200 and r.json()["data"] == [], (listing, r.text)
    # The SDK says so too: its NotFound, where it gave an empty page.
    async with AsyncClient(live_rt.url, acme) as sdk:
        for read in (lambda u: sdk.list_facts("web", u), lambda u: sdk.list_events("web", u, order="newest"),
                     lambda u: sdk.search_events("web", u, "hello", k=3)):
            with pytest.raises(NotFound, match="agent 'web' has no user 'ada'"):
                await read("ada")
            assert (await read("bea"))["data"] == []


APP_AGENT = '''
import http.server, threading


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"app of the user"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def _serve():
    http.server.ThreadingHTTPServer.allow_reuse_address = True
    try:
        http.server.ThreadingHTTPServer(("127.0.0.1", 8080), Handler).serve_forever()
    except OSError:
        pass  # loaded again in the same sandbox: the first server keeps serving


threading.Thread(target=_serve, daemon=True).start()


async def on_message(ctx, message):
    return "ok"
'''


def _app_archive(tmp_path: Path) -> bytes:
    """An agent with an app and the default ``users = "existing"``: its app serves only users it has."""
    root = tmp_path / "src-shop"
    root.mkdir(parents=True, exist_ok=True)
    (root / "moorage.toml").write_text('[agent]\nname = "shop"\nentry = "agent.py"\nports = [8080]\n')
    (root / "agent.py").write_text(APP_AGENT)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for p in sorted(root.iterdir()):
            tar.add(p, arcname=p.name)
    return buf.getvalue()


async def test_a_share_link_is_made_for_a_user_with_only_a_session(live_rt, acme: str, store: Store,  # noqa: F811
                                                                   tmp_path: Path) -> None:
    ts = store.tenant(store.authenticate(acme))
    async with aclient(live_rt, acme) as a:
        assert (await a.post("/v1/agents/shop/deployments", content=_app_archive(tmp_path), headers=GZ)).status_code == 201
        # old: talked to the agent before users were per agent (a session, no registration), as a store migrated
        # from then holds them. cut: an instance left, neither registered nor with a session.
        for user in ("old", "cut"):
            assert (await a.put(f"/v1/agents/shop/users/{user}", json={})).status_code == 201
        assert (await a.post("/v1/agents/shop/invoke", json={"message": "hi", "user": "old"})).json()["reply"] == "ok"
        assert (await a.put("/v1/agents/shop/users/cut?provision=true", json={})).status_code == 200
        for user in ("old", "cut"):
            assert ts.agent_users.delete("shop", user)
        assert ts.sessions.list("shop", "old", limit=1) and not ts.sessions.list("shop", "cut", limit=1)

        # The app serves old (a turn of theirs would too) and refuses cut: the links follow.
        r = await a.post("/v1/agents/shop/users/old/share-links", json={"ttl_s": 600})
        assert r.status_code == 201, r.text
        link = r.json()
        r = await a.post("/v1/agents/shop/users/cut/share-links", json={"ttl_s": 600})
        assert r.status_code == 404 and r.json()["detail"] == "agent 'shop' has no user 'cut'", r.text
        assert (await a.get("/v1/agents/shop/users/cut/app/")).status_code == 404
        r = await a.post("/v1/agents/shop/users/nobody/share-links", json={"ttl_s": 600})
        assert r.status_code == 404 and r.json()["detail"] == "agent 'shop' has no user 'nobody'", r.text
    async with aclient(live_rt) as anyone:
        r = await anyone.get(link["url"])
        assert r.status_code == 200 and r.text == "app of the user", r.text
    async with aclient(live_rt, acme) as a:
        assert (await a.get("/v1/agents/shop/users/old")).status_code == 200  # registered by the link's first use
        listed = (await a.get("/v1/agents/shop/users/old/share-links")).json()["data"]
        assert [x["id"] for x in listed] == [link["id"]]
    # Another tenant's user of the same name is no user of its agent of the same name.
    _, other_key = store.operator.create_tenant("initech")
    async with aclient(live_rt, other_key.secret) as o:
        assert (await o.post("/v1/agents/shop/deployments", content=_app_archive(tmp_path), headers=GZ)).status_code == 201
        r = await o.post("/v1/agents/shop/users/old/share-links", json={"ttl_s": 600})
        assert r.status_code == 404 and r.json()["detail"] == "agent 'shop' has no user 'old'", r.text
