"""Ten turns that each write a file, learn a fact, record an event and journal a step; roll back to turn 4 and
fork at turn 4 — through the real runtime with process sandboxes."""

from __future__ import annotations

import json
from pathlib import Path

from moorage.store import EntityKey, Scope
from moorage.store.repos import checkpoint_image
from moorage.store.repos.checkpoints import Checkpoints
from tests.runtime.conftest import write_agent
from tests.timetravel.conftest import AGENT, TIMETRAVEL, store_view


async def _turns(env, user: str, numbers) -> list[str]:
    out = []
    for n in numbers:
        out.append((await env.runtime.invoke(env.principal, EntityKey("tt", user), f"turn {n}")).reply)
    # The last turn's automatic checkpoint is taken after its reply: wait for it before reading the store.
    await env.runtime.timetravel.settled(env.store.tenant(env.principal).tenant_id, "tt", user)
    return out


async def _turn_checkpoint(env, user: str, n: int) -> str:
    listing = await env.runtime.timetravel.list(env.principal, "tt", user)
    ids = [c["id"] for c in listing["data"] if c["kind"] == "turn" and c["current_branch"]
           and (c["summary"].get("turn") or {}).get("message") == f"turn {n}"]
    assert len(ids) == 1, listing["data"]
    return ids[0]


async def _ask(env, user: str, message: str) -> str:
    return (await env.runtime.invoke(env.principal, EntityKey("tt", user), message)).reply


async def test_rollback_to_turn_4_restores_files_facts_search_and_journal(both_env, tmp_path: Path) -> None:
    env = both_env
    await env.runtime.deploy(env.principal, write_agent(tmp_path / "agent", "tt", AGENT, extra_manifest=TIMETRAVEL))
    ts = env.store.tenant(env.principal)
    first = await _turns(env, "ada", range(1, 5))
    after4 = store_view(ts, "tt", "ada")
    files4 = await _ask(env, "ada", "ls")
    recall4 = await _ask(env, "ada", "recall milestone reached")
    # ls and recall are turns too: the state to come back to is the one after them.
    after4 = store_view(ts, "tt", "ada")
    first += await _turns(env, "ada", range(5, 11))
    assert first[3] == "done 4 step=40 files=4" and first[9] == "done 10 step=100 files=10"
    after10 = store_view(ts, "tt", "ada")
    files10 = await _ask(env, "ada", "ls")
    assert len(json.loads(files10)) == 10

    listing = await env.runtime.timetravel.list(env.principal, "tt", "ada")
    turn = next(c for c in listing["data"] if (c["summary"].get("turn") or {}).get("message") == "turn 7")
    assert turn["summary"]["turn"]["reply"] == "done 7 step=70 files=7"
    assert [s["name"] for s in turn["summary"]["turn"]["steps"]] == ["side-7"]

    # The checkpoint after the "recall" turn that followed turn 4 is the point to return to.
    recall_ck = next(c["id"] for c in listing["data"]
                     if (c["summary"].get("turn") or {}).get("message") == "recall milestone reached")
    result = await env.runtime.timetravel.rollback(env.principal, "tt", "ada", recall_ck)
    assert result["rolled_back_to"] == recall_ck

    assert store_view(ts, "tt", "ada") == after4  # facts (current and as-of), events, runs, steps, journal, state
    assert await _ask(env, "ada", "ls") == files4  # the sandbox's files
    after_ls = store_view(ts, "tt", "ada")
    assert await _ask(env, "ada", "recall milestone reached") == recall4  # memory search
    assert after_ls["facts"] == after4["facts"]

    # Turn 5 again behaves as the first turn 5 did.
    assert await _ask(env, "ada", "turn 5") == first[4] == "done 5 step=50 files=5"

    # The abandoned branch is listed and can be restored.
    listing = await env.runtime.timetravel.list(env.principal, "tt", "ada")
    assert len(listing["branches"]) == 2
    abandoned = next(b for b in listing["branches"] if not b["current"])
    assert abandoned["tip"] == result["abandoned"]["tip"]
    await env.runtime.timetravel.rollback(env.principal, "tt", "ada", abandoned["tip"])
    assert await _ask(env, "ada", "ls") == files10
    back = store_view(ts, "tt", "ada")
    assert back["facts"] == after10["facts"]
    assert [e for e in back["events"] if e[0] == "note"] == [e for e in after10["events"] if e[0] == "note"]


async def test_fork_at_turn_4_into_three_users_that_diverge(both_env, tmp_path: Path) -> None:
    env = both_env
    await env.runtime.deploy(env.principal, write_agent(tmp_path / "agent", "tt", AGENT, extra_manifest=TIMETRAVEL))
    ts = env.store.tenant(env.principal)
    await _turns(env, "ada", range(1, 7))
    original = store_view(ts, "tt", "ada")
    original_files = await _ask(env, "ada", "ls")
    original = store_view(ts, "tt", "ada")
    ck4 = await _turn_checkpoint(env, "ada", 4)

    out = await env.runtime.timetravel.fork(env.principal, "tt", "ada", ck4, ["b1", "b2", "b3"])
    assert [f["user"] for f in out["forks"]] == ["b1", "b2", "b3"]
    assert store_view(ts, "tt", "ada") == original  # the source is unchanged
    assert await _ask(env, "ada", "ls") == original_files

    for i, user in enumerate(("b1", "b2", "b3")):
        files = json.loads(await _ask(env, user, "ls"))
        assert sorted(files) == ["1.txt", "2.txt", "3.txt", "4.txt"]  # the sandbox as of turn 4
        assert files["4.txt"] == "note 4 for ada"
        facts = [f.value for f in ts.facts.list(__import__("moorage.store", fromlist=["Scope"]).Scope.for_user("tt", user),
                                                  statuses=("active", "pending"))]
        assert facts and facts[-1] == "4"
        assert await _ask(env, user, f"turn {50 + i}") == f"done {50 + i} step={(50 + i) * 10} files=5"

    for i, user in enumerate(("b1", "b2", "b3")):
        files = json.loads(await _ask(env, user, "ls"))
        assert sorted(files) == sorted(["1.txt", "2.txt", "3.txt", "4.txt", f"{50 + i}.txt"])  # none sees another's
        hits = json.loads(await _ask(env, user, "recall milestone reached"))
        assert f"milestone {50 + i} reached by the user" in hits
        assert not any(f"milestone {50 + j} " in h for j in range(3) if j != i for h in hits)
        assert "milestone 6 reached by the user" not in hits  # nor the source's later writes
    assert json.loads(await _ask(env, "ada", "ls")).keys() == json.loads(original_files).keys()


async def test_store_checkpoint_costs_only_changed_rows(env, tmp_path: Path) -> None:
    await env.runtime.deploy(env.principal, write_agent(tmp_path / "agent", "tt", AGENT, extra_manifest=TIMETRAVEL))
    ts = env.store.tenant(env.principal)
    await _turns(env, "ada", range(1, 4))
    cks = Checkpoints(ts).list("tt", "ada")
    assert [c.seq for c in cks] == [3, 2, 1]
    with ts.transaction():
        bodies = ts.ambient().q("SELECT COUNT(*) FROM checkpoint_rows")[0][0]  # type: ignore[union-attr]
        image = checkpoint_image.read(ts.ambient(), "tt", "ada").manifest  # type: ignore[arg-type]
    rows_now = sum(len(r) for r in image.rows.values())
    # Three checkpoints of a growing instance store fewer bodies than three full copies would.
    assert bodies < 2 * rows_now


async def test_retention_keeps_the_newest_and_named_and_deletes_the_rest_with_their_sandbox_copies(env, tmp_path: Path) -> None:
    root = write_agent(tmp_path / "agent", "tt", AGENT, extra_manifest=TIMETRAVEL + "keep = 3\ndaily = 0\n")
    await env.runtime.deploy(env.principal, root)
    ts = env.store.tenant(env.principal)
    await _turns(env, "ada", range(1, 3))
    named = await env.runtime.timetravel.take(env.principal, "tt", "ada", "keep-me")
    await _turns(env, "ada", range(3, 12))  # the 10th checkpoint prunes
    left = Checkpoints(ts).list("tt", "ada")
    assert named.id in {c.id for c in left}
    assert [c.seq for c in left] == [12, 11, 10, 9, 8, 3]  # newest three at the prune (8-10), the named one, later ones
    sandbox = await env.runtime.driver.open(left[0].sandbox_id)
    on_disk = {c.name for c in await sandbox.checkpoints()}
    assert on_disk == {c.sandbox_checkpoint for c in left}
    await env.runtime.timetravel.rollback(env.principal, "tt", "ada", named.id)
    assert sorted(json.loads(await _ask(env, "ada", "ls"))) == ["1.txt", "2.txt"]


async def test_retention_after_a_rollback_keeps_the_history_the_instance_grew_from(env, tmp_path: Path) -> None:
    """The newest ``keep`` are counted along the instance's history: after a rollback to turn 3 and four turns,
    turn 3's checkpoint is one of the newest five of it (it is on the branch the rollback left)."""
    root = write_agent(tmp_path / "agent", "tt", AGENT, extra_manifest=TIMETRAVEL + "keep = 5\ndaily = 0\n")
    await env.runtime.deploy(env.principal, root)
    ts = env.store.tenant(env.principal)
    await _turns(env, "ada", range(1, 6))
    three = await _turn_checkpoint(env, "ada", 3)
    await env.runtime.timetravel.rollback(env.principal, "tt", "ada", three)
    await _turns(env, "ada", range(6, 10))  # the 10th checkpoint prunes
    left = {c.seq: c for c in Checkpoints(ts).list("tt", "ada")}
    assert max(left) == 10 and {7, 8, 9, 10} <= set(left), sorted(left)
    assert three in {c.id for c in left.values()} and 1 not in left and 2 not in left, sorted(left)
    # The listing tells the history (this branch, then 3 on the branch it left) from the abandoned rest (4, 5 and
    # the state the rollback left).
    listing = (await env.runtime.timetravel.list(env.principal, "tt", "ada"))["data"]
    history = {c["seq"] for c in listing if c["in_history"]}
    assert history == {3, 7, 8, 9, 10}, listing
    assert all(not c["in_history"] and not c["current_branch"] for c in listing if c["seq"] not in history)
    # It is still there to go back to, with its sandbox half.
    await env.runtime.timetravel.rollback(env.principal, "tt", "ada", three)
    assert sorted(json.loads(await _ask(env, "ada", "ls"))) == ["1.txt", "2.txt", "3.txt"]


async def test_the_turn_after_a_prune_does_not_wait_for_the_pruned_sandbox_halves(env, tmp_path: Path,
                                                                                monkeypatch) -> None:
    """Retention removes the pruned checkpoints' rows with the turn that pruned and their sandbox halves after the
    instance is let go: a next turn runs while that deletion is stuck; a listing waits for it."""
    import asyncio

    from moorage.sandbox.process import ProcessSandbox

    root = write_agent(tmp_path / "agent", "tt", AGENT, extra_manifest=TIMETRAVEL + "keep = 3\ndaily = 0\n")
    await env.runtime.deploy(env.principal, root)
    ts = env.store.tenant(env.principal)
    release, deleting = asyncio.Event(), asyncio.Event()
    real = ProcessSandbox.delete_checkpoint

    async def stuck(self, name: str) -> None:
        deleting.set()
        await release.wait()
        await real(self, name)

    monkeypatch.setattr(ProcessSandbox, "delete_checkpoint", stuck)
    for n in range(1, 11):  # the 10th checkpoint prunes
        await _ask(env, "ada", f"turn {n}")
    await asyncio.wait_for(deleting.wait(), 30)
    # The instance is free: the next turn and its own checkpoint go ahead while the deletion waits.
    assert await asyncio.wait_for(_ask(env, "ada", "turn 11"), 30) == "done 11 step=110 files=11"
    for _ in range(300):  # turn 11's own checkpoint is taken after its reply, without waiting for the deletion
        left = Checkpoints(ts).list("tt", "ada")
        if len(left) == 4:  # 8-10 kept by the prune (its pruned rows went with the turn that pruned), and 11
            break
        await asyncio.sleep(0.05)
    assert [c.seq for c in left] == [11, 10, 9, 8]
    sandbox = await env.runtime.driver.open(left[0].sandbox_id)
    assert len(await sandbox.checkpoints()) > 4  # their sandbox halves are still there
    listing = asyncio.get_running_loop().create_task(env.runtime.timetravel.list(env.principal, "tt", "ada"))
    await asyncio.sleep(0.2)
    assert not listing.done()  # a listing waits for the deletion
    release.set()
    assert len((await asyncio.wait_for(listing, 30))["data"]) == 4
    assert {c.name for c in await sandbox.checkpoints()} == {c.sandbox_checkpoint for c in left}


async def test_a_zero_retention_agent_gets_no_checkpoints(env, tmp_path: Path) -> None:
    from moorage.errors import InvalidInput

    root = write_agent(tmp_path / "agent", "tt", AGENT, extra_manifest=TIMETRAVEL + "[agent.retention]\nzero_retention = true\n")
    await env.runtime.deploy(env.principal, root)
    await _turns(env, "ada", range(1, 3))
    assert Checkpoints(env.store.tenant(env.principal)).list("tt", "ada") == []
    try:
        await env.runtime.timetravel.take(env.principal, "tt", "ada", "keep-me")
    except InvalidInput as e:
        assert "zero retention" in str(e)
    else:
        raise AssertionError("a checkpoint of a zero-retention agent was taken")


async def test_with_automatic_checkpoints_off_turns_take_none_and_one_can_still_be_taken(env, tmp_path: Path) -> None:
    await env.runtime.deploy(env.principal, write_agent(tmp_path / "agent", "tt", AGENT,
                                                        extra_manifest="[agent.timetravel]\nauto = false\n"))
    await _turns(env, "ada", range(1, 3))
    ts = env.store.tenant(env.principal)
    assert Checkpoints(ts).list("tt", "ada") == []
    ck = await env.runtime.timetravel.take(env.principal, "tt", "ada", "by-hand")
    await _turns(env, "ada", range(3, 5))
    await env.runtime.timetravel.rollback(env.principal, "tt", "ada", ck.id)
    assert sorted(json.loads(await _ask(env, "ada", "ls"))) == ["1.txt", "2.txt"]


async def test_a_checkpoint_whose_sandbox_half_was_never_written_is_refused_before_anything_changes(env, tmp_path: Path) -> None:
    """The automatic checkpoint's sandbox files are written behind its turn; a host that dies meanwhile leaves a
    row naming a sandbox checkpoint that is not there. The listing marks it, rollback and fork to it are refused,
    and nothing moves: no before-rollback checkpoint, no pending operation, no new user, and the instance's turns go
    on."""
    import pytest

    from moorage.timetravel.timeline import CheckpointGone

    await env.runtime.deploy(env.principal, write_agent(tmp_path / "agent", "tt", AGENT, extra_manifest=TIMETRAVEL))
    ts = env.store.tenant(env.principal)
    await _turns(env, "ada", range(1, 4))
    lost = Checkpoints(ts).get("tt", "ada", await _turn_checkpoint(env, "ada", 2))
    sandbox = await env.runtime.driver.open(lost.sandbox_id)
    await sandbox.delete_checkpoint(lost.sandbox_checkpoint)  # as if the host had died before writing it
    before = [c.id for c in Checkpoints(ts).list("tt", "ada")]
    with pytest.raises(CheckpointGone, match="never written"):
        await env.runtime.timetravel.rollback(env.principal, "tt", "ada", lost.id)
    with pytest.raises(CheckpointGone, match="never written"):
        await env.runtime.timetravel.fork(env.principal, "tt", "ada", lost.id, ["bob"])
    assert [c.id for c in Checkpoints(ts).list("tt", "ada")] == before
    assert Checkpoints(ts).head("tt", "ada").pending is None
    assert ts.sandboxes.for_scope(Scope.for_user("tt", "bob")) is None and Checkpoints(ts).list("tt", "bob") == []
    assert sorted(json.loads(await _ask(env, "ada", "ls"))) == ["1.txt", "2.txt", "3.txt"]
    # The listing says which one cannot be restored (the dashboard and the CLI show it, without its buttons).
    listing = await env.runtime.timetravel.list(env.principal, "tt", "ada")
    marks = {c["id"]: c["restorable"] for c in listing["data"]}
    assert marks.pop(lost.id) is False and marks and set(marks.values()) == {True}
    ok = await _turn_checkpoint(env, "ada", 1)  # another checkpoint still rolls back
    await env.runtime.timetravel.rollback(env.principal, "tt", "ada", ok)
    assert sorted(json.loads(await _ask(env, "ada", "ls"))) == ["1.txt"]
