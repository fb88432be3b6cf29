"""The per-user measure of what the store keeps (``ts.footprint``), on both backends: each part counts the content
its user wrote, another user's rows (one whose id extends this one's too) are not counted, and a forgotten user
holds nothing."""

from __future__ import annotations

import base64
import os

from moorage.store import Scope, TenantStore
from moorage.store.repos.footprint import PARTS


def _write(ts: TenantStore, agent: str, user: str, kib: int) -> None:
    """``kib`` KiB in each of memory, facts, state and a workflow's step, plus a checkpoint of it all."""
    text = "x" * (kib << 10)
    scope = Scope.for_user(agent, user)
    ts.events.append(scope, "note", text, embedding=b"\0" * 1536)
    ts.events.append(Scope.session(agent, user, "s1"), "note", text)
    ts.facts.insert(scope, "user", "motto", text, text)
    ts.state.put(scope, "big", {"v": text}, expected_version=0)
    run = ts.runs.create(Scope.workflow(agent, f"r-{agent}-{user}", user), "job", {"in": text})
    ts.runs.record_step(run.id, 0, "fetch", status="done", result={"out": text})
    ts.checkpoints.take(agent, user, kind="manual", name="all")


def test_the_footprint_counts_each_part_of_one_users_store_and_nothing_of_anothers(tenant: TenantStore) -> None:
    assert tenant.footprint.user_bytes("echo", "ada") == dict.fromkeys(PARTS, 0)
    _write(tenant, "echo", "ada", 32)
    _write(tenant, "echo", "ada_2", 8)  # a longer id with this one as its prefix
    _write(tenant, "other", "ada", 8)  # the same user of another agent
    ada = tenant.footprint.user_bytes("echo", "ada")
    k = 32 << 10
    assert 2 * k + 1536 <= ada["memory"] < 2 * k + 1536 + 1024, ada  # two events (user and session), one embedding
    assert 2 * k <= ada["facts"] < 2 * k + 1024, ada  # value and text
    assert k <= ada["state"] < k + 1024, ada
    assert 2 * k <= ada["workflows"] < 2 * k + 1024, ada  # the run's input and its step's result
    # The checkpoint images the rows it holds (memory events stay in the live table while on this branch).
    assert 5 * k <= ada["checkpoints"] < 7 * k, ada
    small = tenant.footprint.user_bytes("echo", "ada_2")
    assert sum(small.values()) < sum(ada.values()) / 3, small
    same = tenant.footprint.user_bytes("other", "ada")  # the same writes; checkpoint ids and names differ in length
    assert all(abs(same[p] - small[p]) < 64 for p in PARTS), (same, small)

    tenant.forget_user("ada", "echo")
    assert tenant.footprint.user_bytes("echo", "ada") == dict.fromkeys(PARTS, 0)
    assert tenant.footprint.user_bytes("echo", "ada_2") == small


def test_a_user_with_more_sessions_than_one_statement_names_is_counted_whole(tenant: TenantStore) -> None:
    for i in range(520):  # past the scopes one read names (500)
        tenant.events.append(Scope.session("echo", "cy", f"s{i}"), "note", "0123456789")
    assert tenant.footprint.user_bytes("echo", "cy")["memory"] == 520 * (10 + len("{}"))


def test_a_tenants_store_bytes_count_its_own_writes_and_free_what_it_forgets(tenant: TenantStore,
                                                                            other_tenant: TenantStore) -> None:
    """``tenant_bytes`` (the tenant ceiling's measure, usage/tenant_cap.py): the tenant's file's pages in use on
    SQLite, its rows on PostgreSQL; another tenant's writes are not its, and what a forget deletes is room again."""
    before, other_before = tenant.footprint.tenant_bytes(), other_tenant.footprint.tenant_bytes()
    size = 80 * (48 << 10)  # 4 users x 20 memories of 48 KiB of text that does not compress (PostgreSQL would)
    for i in range(4):
        _write(tenant, "echo", f"u{i}", 0)
        for _ in range(20):
            text = base64.b64encode(os.urandom(36 << 10)).decode()
            tenant.events.append(Scope.for_user("echo", f"u{i}"), "note", text)
    grown = tenant.footprint.tenant_bytes() - before
    # About twice the text: memories are also kept in the full-text index (a tsvector on PostgreSQL, FTS5 on SQLite).
    assert size <= grown < size * 3, grown
    assert other_tenant.footprint.tenant_bytes() == other_before  # the other tenant's file, or rows, unchanged
    for i in range(4):
        tenant.forget_user(f"u{i}")
    freed = before + grown - tenant.footprint.tenant_bytes()
    assert freed >= size, (freed, grown)
