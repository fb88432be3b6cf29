"""Episodic memory: the time-ordered event log of a scope, embedded on write or soon after, searched hybrid.

Lexical (the store's full-text search) and dense (exact cosine over one scope's vectors) rankings are fused and re-ranked by recency.
The scope's index (vectors, BM25 postings) and its cache are in episodic_index.py, the rankings in episodic_rank.py.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from moorage.errors import InvalidInput
from moorage.memory.embeddings import Embedder, default_embedder, to_bytes
from moorage.memory.episodic_index import ScopeIndexes, _ScopeVectors
from moorage.memory.episodic_rank import Rankings, _query_words
from moorage.memory.ranking import FusionWeights, fuse, weights_for
from moorage.store import Event, EventIn, Scope, TenantStore

#: A question in the first person is about the user.
_FIRST_PERSON = re.compile(r"\b(?:i|me|my|mine|myself|i'm|i've)\b", re.I)

#: Pruning starts once a scope has this many events (below it every query is cheap anyway).
_PRUNE_MIN_EVENTS = 2000
#: Words in more than this share of a scope's events are left out of the full-text query.
_PRUNE_MAX_DF = 0.05
_PRUNE_MAX_WORDS = 6


@dataclass(frozen=True)
class Recall:
    """One retrieved event with how it was found (ranks are 1-based; ``None``: not in that list)."""

    event: Event
    score: float
    lexical_rank: int | None
    dense_rank: int | None

    def as_json(self) -> dict[str, Any]:
        """A search hit as the agent's ``ctx.memory.recall`` and the API's ``GET …/events/search`` both return it
        (docs/memory.md): the event's fields at the top (``text`` is its ``content``), ``score``, and the whole
        event under ``event``, so code written against either side reads the other."""
        e = self.event
        whole = {"id": e.id, "scope": e.scope.key, "ts": e.ts, "kind": e.kind, "speaker": e.speaker,
                 "content": e.content, "meta": e.meta}
        return {"id": e.id, "text": e.content, "speaker": e.speaker, "ts": e.ts, "kind": e.kind,
                "scope": e.scope.key, "meta": e.meta, "score": self.score, "event": whole}


class EpisodicMemory(Rankings, ScopeIndexes):
    """Episodic memory over one tenant's store handle. Every call names one scope and never leaves it.

    Dense search is exact (a matrix product over the scope's vectors), not an approximate global index:
    a user's log is small enough, and there is no index shared across tenants or users to leak through.
    Vectors are cached per scope in this process and refreshed incrementally from the store.
    """

    def __init__(
        self,
        ts: TenantStore,
        embedder: Embedder | None = None,
        *,
        weights: FusionWeights = FusionWeights(),
        pool: int = 50,
        max_cached_vectors: int = 500_000,
        lazy_embed: int = 64,
    ) -> None:
        self.ts = ts
        self.embedder = embedder or default_embedder()
        self.weights = weights
        self.pool = pool
        self.max_cached_vectors = max_cached_vectors
        #: A search embeds at most this many of its scope's events still without a vector (newest first).
        self.lazy_embed = lazy_embed
        self._cache: OrderedDict[str, _ScopeVectors] = OrderedDict()
        self._cache_lock = threading.Lock()

    # -- writing -------------------------------------------------------------------------------

    def remember(
        self, scope: Scope, kind: str, content: str, *, speaker: str | None = None,
        meta: dict[str, Any] | None = None, ts: float | None = None,
    ) -> Event:
        """Append one event with its embedding (computed now, so queries never embed the log)."""
        return self.remember_many(scope, [EventIn(kind, content, speaker, meta, ts)])[0]

    def remember_many(self, scope: Scope, items: Sequence[EventIn]) -> list[Event]:
        """Append events in one transaction; their embeddings are computed in batches first."""
        if not items:
            return []
        vectors = self.embedder.embed([it.content for it in items])
        rows = [EventIn(it.kind, it.content, it.speaker, it.meta, it.ts, to_bytes(v)) for it, v in zip(items, vectors)]
        return self.ts.events.append_many(scope, rows)

    def remember_pending(self, scope: Scope, items: Sequence[EventIn]) -> list[Event]:
        """Append events now and embed them later (``embed_pending``, or the next search of their scope).

        Nothing is computed here, so it is cheap inside a caller's transaction: a turn writes its messages in
        the same commit as its result. Full-text search finds them at once; the NULL embedding is the marker
        (indexed, migration 10) by which a restarted host finds what is still to embed.
        """
        return self.ts.events.append_many(scope, [EventIn(it.kind, it.content, it.speaker, it.meta, it.ts) for it in items])

    def embed_pending(self, *, batch: int = 64, stop: Callable[[], bool] = lambda: False) -> int:
        """Embed every event of this tenant still without a vector, oldest first; one commit per batch
        (``stop`` is asked before each batch)."""
        done, after = 0, 0
        while not stop():
            events = self.ts.events.unembedded(after=after, limit=batch)
            if not events:
                return done
            after = events[-1].id
            vectors = self.embedder.embed([e.content for e in events])
            by_scope: dict[Scope, list[tuple[int, bytes]]] = defaultdict(list)
            for e, v in zip(events, vectors):
                by_scope[e.scope].append((e.id, to_bytes(v)))
            with self.ts.transaction():
                for scope, rows in by_scope.items():
                    self.ts.events.put_embeddings(scope, rows)
            done += len(events)
            if len(events) < batch:
                return done
        return done

    def backfill(self, scope: Scope, *, batch: int = 256) -> int:
        """Embed events of ``scope`` that were appended without a vector (e.g. straight through the store)."""
        have = {i for i, _ in self.ts.events.embeddings(scope)}
        missing = [e for e in self.ts.events.list(scope, limit=10**9) if e.id not in have]
        for start in range(0, len(missing), batch):
            chunk = missing[start : start + batch]
            vecs = self.embedder.embed([e.content for e in chunk])
            self.ts.events.put_embeddings(scope, [(e.id, to_bytes(v)) for e, v in zip(chunk, vecs)])
        if missing:
            self._drop(scope)
        return len(missing)

    # -- reading -------------------------------------------------------------------------------

    def search(
        self, scope: Scope, query: str, *, k: int = 10, since: float | None = None, until: float | None = None,
        speakers: Sequence[str] | None = None,
    ) -> list[Recall]:
        """The ``k`` events of ``scope`` that best answer ``query``: lexical + dense, fused, recency re-ranked."""
        if not query.strip():
            raise InvalidInput("empty memory query", hint="pass the question or topic to recall")
        if not 1 <= k <= 1000:
            raise InvalidInput(f"k={k} is out of range", hint="ask for 1 to 1000 results")
        vec = self._vectors(scope)
        # Embedded on this thread: the store reads left on the query path (a COUNT, then the head's
        # rows by id) take well under a millisecond, less than handing the work to a worker thread
        # and waking up again costs on a busy host.
        qv = self.embedder.embed_one(query)
        words = _query_words(query)
        # "Where did I work before joining Hooli?": the event naming Hooli is the reference point, not
        # the answer, which is older. Search only before that event, without the words that name it.
        anchor = self._anchor(vec, query, qv, since=since, until=until, speakers=speakers) if self.weights.anchor else None
        if anchor is not None:
            until = float(vec.lex_ts[anchor.row]) - 1e-6
            words = [w for w in words if w not in anchor.words]
        lexical = self._bm25(vec, words, limit=self.pool, since=since, until=until, speakers=speakers)
        if anchor is not None and anchor.event_id in vec.pos:
            # The answer is about the same thing as the anchor ("joined Hooli" -> another job): add the
            # anchor's vector to the query's, so the older statements of that topic rank first.
            q2 = qv + self.weights.anchor * vec.matrix[vec.pos[anchor.event_id]]
            qv = (q2 / np.linalg.norm(q2)).astype(np.float32)
        dense = self._dense(vec, qv, limit=self.pool, since=since, until=until, speakers=speakers)
        lex_ids = [i for i, _ in lexical]
        dense_ids = [i for i, _ in dense]
        # Every candidate gets its true cosine (all vectors are at hand), not only the dense top-N.
        pos = vec.pos
        cos = dict(dense)
        for i in lex_ids:
            if i not in cos and i in pos:
                cos[i] = float(np.dot(vec.matrix[pos[i]], qv))
        unembedded = [i for i in lex_ids if i not in cos]
        if unembedded and cos:
            # No vector yet (written for embedding later): its lexical evidence stands in for the dense one,
            # rather than counting as the least similar event of the pool.
            hi, lo, top = max(cos.values()), min(cos.values()), lexical[0][1]
            lex_score = dict(lexical)
            for i in unembedded:
                cos[i] = lo + (hi - lo) * lex_score[i] / top
        times = self._times(vec, set(lex_ids) | set(dense_ids))
        fused = fuse(dict(lexical), cos, times, weights_for(query, self.weights), now=until)
        if self.weights.other_speaker_penalty and _FIRST_PERSON.search(query):
            # A question about the user themself ("where do I work?") is answered by what the user said;
            # the assistant's turns ("Noted, I will keep that in mind.") echo the topic without the fact.
            # A penalty, not a filter: an assistant turn that matches much better still ranks.
            fused = self._prefer_speaker(vec, fused, self.weights.self_speaker, self.weights.other_speaker_penalty)
        # Fetch a few more than k: exact repeats ("ok, thanks") are collapsed into their newest copy.
        head = fused[: 2 * k]
        # Content always comes from the store, so an event deleted since the cache was filled is skipped.
        events = {e.id: e for e in self.ts.events.get_many(scope, [i for i, _ in head])}
        lex_rank = {i: n for n, i in enumerate(lex_ids, start=1)}
        dense_rank = {i: n for n, i in enumerate(dense_ids, start=1)}
        out: list[Recall] = []
        seen: set[str] = set()
        for i, s in head:
            ev = events.get(i)
            if ev is None:
                continue
            text = " ".join(ev.content.lower().split())
            if text in seen:
                continue
            seen.add(text)
            out.append(Recall(ev, s, lex_rank.get(i), dense_rank.get(i)))
            if len(out) == k:
                break
        return out
    def search_lexical(
        self, scope: Scope, query: str, *, limit: int = 50, since: float | None = None, until: float | None = None,
        speakers: Sequence[str] | None = None,
    ) -> list[tuple[Event, float]]:
        vec = self._vectors(scope)
        return self._lexical(scope, vec, query, limit=limit, since=since, until=until, speakers=speakers)
    def _lexical(
        self, scope: Scope, vec: _ScopeVectors, query: str, *, limit: int, since: float | None, until: float | None,
        speakers: Sequence[str] | None,
    ) -> list[tuple[Event, float]]:
        words = _query_words(query)
        if vec.seen >= _PRUNE_MIN_EVENTS and len(words) > 1:
            # The store ORs the words, so the cost grows with how many events each word matches, while a
            # word in many events adds almost nothing to bm25 (low idf). Keep the rarest few words.
            by_rarity = sorted(words, key=lambda w: vec.df.get(w, 0))
            keep = [w for w in by_rarity if vec.df.get(w, 0) <= _PRUNE_MAX_DF * vec.seen][:_PRUNE_MAX_WORDS]
            words = keep or by_rarity[:1]
        if not words:
            return []
        return self.ts.events.search_text(scope, " ".join(words), limit=limit, since=since, until=until, speakers=speakers)

    def search_dense(
        self, scope: Scope, query: str, *, limit: int = 50, since: float | None = None, until: float | None = None,
        speakers: Sequence[str] | None = None,
    ) -> list[tuple[int, float]]:
        """Event ids of ``scope`` by cosine similarity to ``query`` (exact search), best first."""
        vec = self._vectors(scope)
        if len(vec.ids) == 0:
            return []
        return self._dense(vec, self.embedder.embed_one(query), limit=limit, since=since, until=until, speakers=speakers)
