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
