"""The per-scope vector cache grows in place: new vectors land past what a reader's snapshot covers, the cache equals
one built from scratch, and searches rank as a cold cache does (both store backends)."""

from __future__ import annotations

import numpy as np

from moorage.memory.embeddings import DIMENSION, Embedder, to_bytes
from moorage.memory.episodic import EpisodicMemory
from moorage.store import EventIn, Scope, TenantStore

ANN = Scope.for_user("concierge", "ann")


def _append(ts: TenantStore, rng: np.random.Generator, start: int, k: int) -> None:
    v = rng.standard_normal((k, DIMENSION)).astype(np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    ts.events.append_many(ANN, [EventIn("note", f"milestone {start + j} word{(start + j) % 7}", "agent", None, None,
                                        to_bytes(v[j])) for j in range(k)])


def test_refreshes_append_in_place_and_equal_a_cold_cache(tenant: TenantStore, embedder: Embedder) -> None:
    rng = np.random.default_rng(7)
    warm = EpisodicMemory(tenant, embedder)
    _append(tenant, rng, 0, 5)
    first = warm._vectors(ANN)
    snapshot, copy = first.matrix, first.matrix.copy()  # what a search running now would hold
    n = 5
    for k in (3, 250, 1, 400, 2):  # crossing the buffer's growth more than once
        _append(tenant, rng, n, k)
        n += k
        vec = warm._vectors(ANN)
        assert vec.matrix.shape == (n, DIMENSION) and len(vec.ids) == n and len(vec.room) >= n
    assert np.array_equal(snapshot, copy)  # earlier readers' rows never change under them

    cold = EpisodicMemory(tenant, embedder)._vectors(ANN)
    assert np.array_equal(vec.ids, cold.ids) and np.array_equal(vec.matrix, cold.matrix)
    stored = dict(tenant.events.embeddings(ANN))
    assert all(np.array_equal(vec.matrix[vec.pos[i]], np.frombuffer(stored[i], dtype="<f4")) for i in vec.ids.tolist())

    for query in ("milestone word3", "milestone 600"):
        got = [(r.event.id, round(r.score, 6)) for r in warm.search(ANN, query, k=10)]
        want = [(r.event.id, round(r.score, 6)) for r in EpisodicMemory(tenant, embedder).search(ANN, query, k=10)]
        assert got == want and len(got) == 10
