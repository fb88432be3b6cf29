"""`moorage up` on the micro-VM driver SIGKILLed while a turn's automatic checkpoint was still being written behind
its reply: the store row was there, its sandbox files were not. The row stayed a turn checkpoint: the tip of its
branch (which retention keeps when the branch is abandoned, in place of the last one that can be restored) that a
rollback refused. The next start marks it missing."""

from __future__ import annotations

from tests.lifecycle.crash_up import Up
from tests.lifecycle.test_crash_microvm import _instance, up  # noqa: F401 - fixture
from tests.lifecycle.test_crash_operations import GZ, _in_background, _tt_archive


def test_killed_while_an_automatic_checkpoint_is_written_its_row_is_missing_after_the_restart(up: Up) -> None:
    up.start()
    with up.client() as c:
        assert c.post("/v1/agents/tt/deployments", content=_tt_archive(), headers=GZ).status_code == 201
        assert c.post("/v1/agents/tt/invoke", json={"message": "m0", "user": "ada"}).json()["reply"] == "noted m0"
        (first,) = c.get("/v1/agents/tt/users/ada/checkpoints").json()["data"]
    up.stop()

    # Killed once the row of m1's checkpoint is written: its files are still being written behind the reply.
    up.start("moorage.store.repos.checkpoints:Checkpoints.take", after=True)
    with up.client() as c:
        _in_background(lambda: c.post("/v1/agents/tt/invoke", json={"message": "m1", "user": "ada"}))
        assert up.died()
    cps = _instance(up) / "checkpoints"
    assert not [p for p in cps.iterdir() if (p / "snapshot.json").exists() and p.name != first["sandbox_checkpoint"]]

    up.start()
    with up.client() as c:
        out = c.get("/v1/agents/tt/users/ada/checkpoints").json()
        latest, before = out["data"]
        assert before["id"] == first["id"] and before["restorable"] is True
        assert latest["kind"] == "missing" and latest["restorable"] is False, latest
        assert "written behind" in latest["summary"]["error"]
        assert [b["tip"] for b in out["branches"]] == [first["id"]]  # the last point that can be gone back to
        r = c.post(f"/v1/agents/tt/users/ada/checkpoints/{latest['id']}/rollback")
        assert r.status_code == 409 and "missing" in r.json()["detail"], r.text
        r = c.post(f"/v1/agents/tt/users/ada/checkpoints/{first['id']}/rollback")
        assert r.status_code == 200, r.text
        assert c.post("/v1/agents/tt/invoke", json={"message": "m2", "user": "ada"}).json()["reply"] == "noted m2"
        kinds = [d["kind"] for d in c.get("/v1/agents/tt/users/ada/checkpoints").json()["data"]]
        assert kinds.count("missing") == 1 and kinds[0] == "turn", kinds


def _marked(up: Up) -> list[str]:
    """The checkpoints still marked as being written behind their turns (store migration 29)."""
    from moorage.config import Config
    from moorage.store import open_store

    store = open_store(Config(data_dir=up.data))
    try:
        return [r[0] for ts in store.operator.tenants() for r in ts.read("SELECT id FROM checkpoints WHERE writing = 1")]
    finally:
        store.close()


def test_killed_once_the_files_are_written_but_not_yet_recorded_the_checkpoint_stays_restorable(up: Up) -> None:
    """A checkpoint is marked from its row's insert until its files are written; a host killed between the two
    leaves the mark. The next start reads only marked rows: this one's files are there, so it stays a turn
    checkpoint and its mark goes (it is not read at every start from then on)."""
    up.start("moorage.store.repos.checkpoints:Checkpoints.written")  # killed as it would clear the mark
    with up.client() as c:
        assert c.post("/v1/agents/tt/deployments", content=_tt_archive(), headers=GZ).status_code == 201
        _in_background(lambda: c.post("/v1/agents/tt/invoke", json={"message": "m0", "user": "ada"}))
        assert up.died()
    (marked,) = _marked(up)
    up.start()
    with up.client() as c:
        (ck,) = c.get("/v1/agents/tt/users/ada/checkpoints").json()["data"]
        assert ck["id"] == marked and ck["kind"] == "turn" and ck["restorable"] is True, ck
        assert c.post("/v1/agents/tt/invoke", json={"message": "m1", "user": "ada"}).json()["reply"] == "noted m1"
        assert len(c.get("/v1/agents/tt/users/ada/checkpoints").json()["data"]) == 2
    assert _marked(up) == []
