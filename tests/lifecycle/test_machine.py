"""The instance state machine on the real store: only listed transitions happen, each is compare-and-set and traced."""

from __future__ import annotations

import pytest

from moorage.errors import ConflictError
from moorage.lifecycle import machine
from moorage.lifecycle.machine import TRANSITIONS, IllegalTransition, InstanceState, Owner, Verb
from moorage.store import Scope, TenantStore

SCOPE = Scope.for_user("helper", "alice")


def _provisioned(ts: TenantStore, me: Owner):
    return machine.provision(ts, SCOPE, owner=me, template_ref="tpl", sandbox_id="sb1")


def test_full_life_is_traced_with_tenant_scope_attributes(tenant: TenantStore) -> None:
    me = Owner.this_process("host-a")
    rec = _provisioned(tenant, me)
    assert rec.state == "provisioning" and machine.claim_of(rec)["owner"] == me.id
    for verb, expect in [(Verb.PROVISIONED, "running"), (Verb.CLAIM_SLEEP, "suspending"), (Verb.SLEPT, "sleeping"),
                         (Verb.CLAIM_WAKE, "waking"), (Verb.WOKE, "running"), (Verb.CLAIM_SLEEP, "suspending"),
                         (Verb.SLEPT, "sleeping"), (Verb.ARCHIVE, "archived"), (Verb.DELETE, "deleted")]:
        before = rec
        rec = machine.apply(tenant, rec, verb, owner=me)
        assert rec.state == expect and rec.version == before.version + 1
        # Transitional states carry the claim of who moves them on; settled ones do not.
        assert (machine.claim_of(rec) is not None) == (InstanceState(expect) in machine.CLAIMED_STATES)
    machine.remove(tenant, rec, owner=me)
    assert tenant.sandboxes.for_scope(SCOPE) is None
    spans = [s for s in tenant.spans.recent(limit=100) if s.name.startswith("lifecycle.")]
    assert len(spans) == 11
    for s in spans:
        assert s.scope == SCOPE
        assert s.attrs["tenant"] == tenant.tenant_id and s.attrs["agent"] == "helper" and s.attrs["user"] == "alice"
        assert s.attrs["instance"] == "sb1" and s.attrs["host"] == "host-a"
    assert {s.name for s in spans} >= {"lifecycle.provision", "lifecycle.woke", "lifecycle.slept", "lifecycle.removed"}


def test_every_verb_not_in_the_table_is_refused(tenant: TenantStore) -> None:
    me = Owner.this_process("host-a")
    rec = _provisioned(tenant, me)
    for verb in Verb:
        if (InstanceState.PROVISIONING, verb) in TRANSITIONS:
            continue
        with pytest.raises(IllegalTransition) as e:
            machine.apply(tenant, rec, verb, owner=me)
        assert e.value.http_status == 409 and "provisioned" in (e.value.hint or "")
    assert tenant.sandboxes.get("sb1").version == rec.version  # nothing was written


def test_stale_version_loses_compare_and_set(tenant: TenantStore) -> None:
    me = Owner.this_process("host-a")
    rec = machine.apply(tenant, _provisioned(tenant, me), Verb.PROVISIONED, owner=me)
    rec = machine.apply(tenant, machine.apply(tenant, rec, Verb.CLAIM_SLEEP, owner=me), Verb.SLEPT, owner=me)
    winner = machine.apply(tenant, rec, Verb.CLAIM_WAKE, owner=me)
    other = Owner.this_process("host-a")
    with pytest.raises(ConflictError):
        machine.apply(tenant, rec, Verb.CLAIM_WAKE, owner=other)  # same stale version: exactly one claim wins
    assert machine.claim_of(tenant.sandboxes.get("sb1"))["owner"] == winner.meta["claim"]["owner"] == me.id


def test_second_provision_of_one_scope_conflicts(tenant: TenantStore) -> None:
    me = Owner.this_process("host-a")
    _provisioned(tenant, me)
    with pytest.raises(ConflictError):
        machine.provision(tenant, SCOPE, owner=me, template_ref="tpl", sandbox_id="sb2")


def test_claims_die_with_their_process_or_their_timeout(tenant: TenantStore) -> None:
    me = Owner.this_process("host-a")
    rec = _provisioned(tenant, me)
    assert not machine.claim_is_dead(rec, me, timeout_s=60)
    assert machine.claim_is_dead(rec, me, timeout_s=60, now=rec.meta["claim"]["at"] + 61)
    ghost = Owner("host-a", "ghost", pid=2 ** 22 + 7, pid_start=1)  # no such process
    rec = machine.apply(tenant, rec, Verb.RECLAIM, owner=ghost)
    assert machine.claim_is_dead(rec, me, timeout_s=60)
    far = Owner("host-b", "remote", pid=2 ** 22 + 7, pid_start=1)  # another host: only the timeout tells
    rec = machine.apply(tenant, rec, Verb.RECLAIM, owner=far)
    assert not machine.claim_is_dead(rec, me, timeout_s=60)


def test_an_awake_period_ended_without_a_sleep_is_billed_once_and_a_stale_one_never(tenant: TenantStore) -> None:
    """Leaving running any other way than a sleep (recovery after a restart, a takeover) bills the period once, up
    to the last activity of its user when another process moves it; a record an earlier version left asleep with a
    stale ``awake_since`` is not billed at its next wake (up to activity long after that period ended)."""
    import time

    dead, me = Owner.this_process("host-a"), Owner.this_process("host-a")
    since = time.time() - 50.0
    rec = machine.apply(tenant, _provisioned(tenant, dead), Verb.PROVISIONED, owner=dead,
                        meta={"owner": dead.claim(), "awake_since": since})
    tenant.state.put(Scope.session("helper", "alice", "s"), "k", 1, expected_version=0)  # its last turn's write
    seen = time.time()
    time.sleep(0.2)
    rec = machine.apply(tenant, rec, Verb.RECOVER, owner=me)  # host restarted: its processes are gone
    (row,) = tenant.read("SELECT amount, meta FROM usage WHERE kind = 'compute_seconds'")
    # Billed up to the last write, not to the recovery: the bound is the write's time (it read the clock once, at
    # the assertion, and a slow recovery on a loaded machine passed it: a CI failure).
    assert 50.0 - 0.5 <= row[0] <= seen - since + 0.5 and "awake_since" not in rec.meta
    # Left asleep with it by an earlier version: the next wake does not bill it.
    stale = tenant.sandboxes.update(rec.id, expected_version=rec.version,
                                    meta={**rec.meta, "awake_since": time.time() - 3600.0})
    machine.apply(tenant, stale, Verb.CLAIM_WAKE, owner=me)
    assert tenant.read("SELECT COUNT(*) FROM usage WHERE kind = 'compute_seconds'") == [(1,)]
