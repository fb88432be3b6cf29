"""A fork into several new users that fails part way (the third user's sandbox cannot be brought up) is undone
whole: none of its users, rows, instances or checkpoints stay, so the same request can be sent again and works."""

from __future__ import annotations

from pathlib import Path

import pytest

from moorage.errors import UnavailableError
from moorage.store import EntityKey, Scope
from tests.runtime.conftest import write_agent
from tests.timetravel.conftest import AGENT, TIMETRAVEL


async def test_a_fork_that_fails_part_way_leaves_nothing_and_its_retry_works(env, tmp_path: Path,  # noqa: ANN001
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    rt = env.runtime
    await rt.deploy(env.principal, write_agent(tmp_path / "agent", "tt", AGENT, extra_manifest=TIMETRAVEL))
    ts = env.store.tenant(env.principal)
    for n in (1, 2):
        await rt.invoke(env.principal, EntityKey("tt", "ada"), f"turn {n}")
    await rt.timetravel.settled(ts.tenant_id, "tt", "ada")
    ck = (await rt.timetravel.list(env.principal, "tt", "ada"))["data"][0]["id"]
    # f2 was registered (with metadata) before the fork, without an instance: it may be forked into.
    ts.agent_users.put("tt", "f2", meta={"plan": "trial"})

    real = rt.instances.ensure_running

    async def third_fails(ts_, scope, *a, **kw):  # noqa: ANN001, ANN002, ANN003
        if scope.user == "f3":
            raise UnavailableError("no room for another sandbox on this host")
        return await real(ts_, scope, *a, **kw)

    monkeypatch.setattr(rt.instances, "ensure_running", third_fails)
    with pytest.raises(UnavailableError):
        await rt.timetravel.fork(env.principal, "tt", "ada", ck, ["f1", "f2", "f3"])
    for u in ("f1", "f2", "f3"):
        assert ts.sandboxes.for_scope(Scope.for_user("tt", u)) is None, u
        assert ts.facts.list(Scope.for_user("tt", u)) == [], u
        assert (await rt.timetravel.list(env.principal, "tt", "ada"))["data"]  # the source keeps its own
    assert ts.agent_users.find("tt", "f1") is None and ts.agent_users.find("tt", "f3") is None
    assert ts.agent_users.find("tt", "f2").meta == {"plan": "trial"}  # as it was before the fork

    monkeypatch.setattr(rt.instances, "ensure_running", real)
    out = await rt.timetravel.fork(env.principal, "tt", "ada", ck, ["f1", "f2", "f3"])
    assert [f["user"] for f in out["forks"]] == ["f1", "f2", "f3"]
    for u in ("f1", "f2", "f3"):
        reply = (await rt.invoke(env.principal, EntityKey("tt", u), "turn 9")).reply
        assert reply == "done 9 step=90 files=3", (u, reply)
