"""The listings that name one end-user (pending facts, checkpoints, share links, the user's own secrets) answer 404
for a user the agent does not have, as a turn or a time-travel verb does, instead of 200 with an empty list that
reads as "this user has none". Another tenant's user of the same name is unknown here. A user the agent has (made
with PUT, by a turn, or holding secrets of their own) who has nothing yet still gets 200 and an empty list, and an
end-user token's own user is never unknown."""

from __future__ import annotations

from pathlib import Path

from tests.api.conftest import acme, aclient, agent_archive, globex, live_rt, runtime  # noqa: F401  (fixtures)

GZ = {"content-type": "application/gzip"}
LISTINGS = ("facts/pending", "checkpoints", "share-links", "secrets")


def _path(user: str, listing: str, agent: str = "web") -> str:
    return f"/v1/agents/{agent}/users/{user}/{listing}"


async def test_listings_of_an_unknown_user_are_404(live_rt, acme: str, globex: str, tmp_path: Path) -> None:  # noqa: F811
    # globex: agent "web" whose user ada talked to it and holds a secret of her own; cleo holds only a secret.
    async with aclient(live_rt, globex) as g:
        assert (await g.post("/v1/agents/web/deployments", content=agent_archive(tmp_path, "web"),
                             headers=GZ)).status_code == 201
        assert (await g.post("/v1/agents/web/invoke", json={"message": "hi", "user": "ada"})).status_code == 200
        for user in ("ada", "cleo"):
            r = await g.put(f"/v1/agents/web/users/{user}/secrets/TOKEN", json={"value": "s3cret"})
            assert r.status_code == 200, r.text
    # acme: an agent of the same name, with bea made (PUT) and nothing else.
    async with aclient(live_rt, acme) as a:
        assert (await a.post("/v1/agents/web/deployments", content=agent_archive(tmp_path, "web"),
                             headers=GZ)).status_code == 201
        assert (await a.put("/v1/agents/web/users/bea", json={})).status_code in (200, 201)
        for listing in LISTINGS:
            for user in ("ada", "cleo", "nobody"):  # globex's users are nobody here
                r = await a.get(_path(user, listing))
                assert r.status_code == 404, (listing, user, r.text)
                problem = r.json()
                assert problem["type"].endswith("/not-found") and problem["detail"] == f"agent 'web' has no user {user!r}", \
                    (listing, problem)
                assert problem["hint"] == "check the user id; GET /v1/agents/web/users lists them", problem
            r = await a.get(_path("bea", listing))  # a user who has nothing yet: an empty list
            assert r.status_code == 200 and r.json()["data"] == [], (listing, r.text)
            r = await a.get(_path("bea", listing, agent="nosuch"))  # an unknown agent stays the agent's 404
            assert r.status_code == 404 and "nosuch" in r.json()["detail"], (listing, r.text)
        # An end-user token names its own user, who may not have talked to the agent yet.
        token = (await a.post("/v1/agents/web/users/dan/tokens", json={})).json()["token"]
    async with aclient(live_rt, token) as end_user:
        r = await end_user.get(_path("dan", "facts/pending"))
        assert r.status_code == 200 and r.json()["data"] == [], r.text
    # In globex the same users are known: their listings answer, with what they have.
    async with aclient(live_rt, globex) as g:
        for listing in LISTINGS:
            r = await g.get(_path("ada", listing))
            assert r.status_code == 200, (listing, r.text)
        assert [s["name"] for s in (await g.get(_path("ada", "secrets"))).json()["data"]] == ["TOKEN"]
        assert [s["name"] for s in (await g.get(_path("cleo", "secrets"))).json()["data"]] == ["TOKEN"]
        assert (await g.get(_path("ada", "checkpoints"))).json()["data"], "ada's turn left a checkpoint"
