"""Zero-retention mode: a stateless agent's data never reaches the disk."""

from __future__ import annotations

import uuid
from pathlib import Path

from moorage.store import Scope, Store
from moorage.store.sqlite import SQLiteBackend
from tests.store.scan import files_containing


def test_ephemeral_handle_writes_nothing_to_disk(tmp_path: Path) -> None:
    store = Store(SQLiteBackend(tmp_path / "store"))
    _, key = store.operator.create_tenant("stateless")
    principal = store.authenticate(key.secret)
    planted = f"planted-{uuid.uuid4().hex}"
    eph = store.ephemeral(principal)
    S = Scope.session("bot", "alice", "s1")
    eph.state.put(S, "k", planted, expected_version=0)
    eph.events.append(S, "message", f"user said {planted}")
    eph.facts.insert(Scope.for_user("bot", "alice"), "alice", "secret", planted, planted)
    with eph.transaction():
        eph.journal.claim(planted)
    assert eph.state.get(S, "k").value == planted
    assert eph.events.search_text(S, planted.split("-")[1])  # it works like the durable store
    # Nothing of it is on disk, in the tenant's file or anywhere else under the data dir.
    assert files_containing(tmp_path, planted.encode()) == []
    # The durable handle of the same tenant does not see it either.
    assert store.tenant(principal).state.get(S, "k") is None
    store.close()
