"""A fact that waited for confirmation is believed from the moment it was confirmed, not from when it was
recorded: ``known_at`` in between answers the value it replaced, and only that; a checkpoint keeps when it was
confirmed. Both store backends."""

from __future__ import annotations

import json
import time

from moorage.memory import FactCandidate, SemanticMemory
from moorage.store import Scope, TenantStore
from moorage.store.repos.checkpoints import Checkpoints

A, U = "concierge", "alice"
ALICE = Scope.for_user(A, U)


def _city(mem: SemanticMemory, value: str, origin: str):  # type: ignore[no-untyped-def]
    return mem.record(ALICE, FactCandidate("user", "city", value, f"lives in {value}"), origin=origin)  # type: ignore[arg-type]


def _pause() -> float:
    time.sleep(0.02)
    t = time.time()
    time.sleep(0.02)
    return t


def test_known_at_before_the_confirmation_answers_the_value_it_replaced(tenant: TenantStore) -> None:
    mem = SemanticMemory(tenant)
    _city(mem, "Lisbon", "user")
    waiting = _city(mem, "Porto", "agent").fact
    assert waiting.status == "pending"
    before = _pause()  # Porto recorded, not yet confirmed
    done = mem.confirm(ALICE, waiting.id)
    after = _pause()
    assert done.fact.confirmed_at is not None and before < done.fact.confirmed_at < after
    assert done.previous is not None and done.previous.superseded_at == done.fact.confirmed_at
    assert [f.value for f in mem.recall(ALICE, known_at=before)] == ["Lisbon"]
    assert [f.value for f in mem.recall(ALICE, known_at=after)] == ["Porto"]
    # At the instant of the confirmation itself, one value too.
    assert [f.value for f in mem.recall(ALICE, known_at=done.fact.confirmed_at)] == ["Porto"]
    # A fact never pending counts from when it was recorded, as before.
    assert tenant.facts.get(done.previous.id).confirmed_at is None


def test_the_pending_facts_page_in_the_order_they_were_recorded(tenant: TenantStore) -> None:
    mem = SemanticMemory(tenant)
    made = [mem.record(ALICE, FactCandidate("user", "likes", f"thing {i}", "x"), origin="tool").fact for i in range(7)]
    mem.reject(ALICE, made[2].id)
    mem.confirm(ALICE, made[5].id)
    seen, after = [], None
    while page := tenant.facts.waiting(ALICE, after=after, limit=2):
        seen += page
        after = (page[-1].recorded_at, page[-1].id)
    assert [f.id for f in seen] == [made[i].id for i in (0, 1, 3, 4, 6)]
    assert tenant.facts.waiting(Scope.for_user(A, "bob")) == []


def test_a_rollback_keeps_when_a_fact_was_confirmed_and_reads_images_from_before_the_column(
        tenant: TenantStore) -> None:
    mem = SemanticMemory(tenant)
    cps = Checkpoints(tenant)
    _city(mem, "Lisbon", "user")
    confirmed = mem.confirm(ALICE, _city(mem, "Porto", "agent").fact.id).fact
    ck = cps.take(A, U)
    _city(mem, "Faro", "user")  # Porto is closed: its row changes
    cps.rollback(A, U, ck.id)
    assert tenant.facts.get(confirmed.id).confirmed_at == confirmed.confirmed_at
    assert mem.current(ALICE, "user", "city").value == "Porto"  # type: ignore[union-attr]

    # A checkpoint taken before migration 20 imaged facts without the column: it restores them (NULL).
    with tenant.transaction():
        c = tenant.ambient()
        for (blob,) in c.q("SELECT body FROM checkpoint_rows WHERE tbl = 'facts'"):
            row = json.loads(blob)
            assert len(row) == 17
            c.x("UPDATE checkpoint_rows SET body = ? WHERE body = ?", (json.dumps(row[:16]), blob))
    _city(mem, "Braga", "user")
    cps.rollback(A, U, ck.id)
    assert mem.current(ALICE, "user", "city").value == "Porto"  # type: ignore[union-attr]
