"""The per-scope index behind episodic search: one scope's event vectors (the cosine matrix) and BM25 postings,
cached in this process per scope and refreshed incrementally from the store (rebuilt after deletions)."""

from __future__ import annotations

import re
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from moorage.log import get_logger
from moorage.memory.embeddings import DIMENSION, Embedder, to_bytes
from moorage.store import Scope, TenantStore

log = get_logger("moorage.memory.episodic")

_WORD = re.compile(r"[A-Za-z0-9]+")


def _tokens(text: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(text)]


#: Events seen without a vector whose vectors one refresh looks up (the newest of them).
_MISSING_CHECK = 512


@dataclass
class _ScopeVectors:
    ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    ts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float64))
    speakers: list[str | None] = field(default_factory=list)
    matrix: np.ndarray = field(default_factory=lambda: np.zeros((0, DIMENSION), dtype=np.float32))
    #: ``matrix`` is a view of the first rows of this buffer, which has room for more: a refresh writes the new
    #: vectors past the rows any reader's snapshot of ``matrix`` covers, instead of copying the whole matrix.
    room: np.ndarray = field(default_factory=lambda: np.zeros((0, DIMENSION), dtype=np.float32))
    max_id: int = 0
    #: Event id -> row of ``matrix``.
    pos: dict[int, int] = field(default_factory=dict)
    #: Events seen without a vector (written for embedding later): looked up again on every refresh.
    missing: set[int] = field(default_factory=set)
    #: Document frequency of lower-cased words over the scope's events, for pruning the full-text query.
    df: Counter[str] = field(default_factory=Counter)
    #: Events of the scope seen so far (with or without a vector): compared with the store's count (and
    #: ``max_id`` with its highest id).
    seen: int = 0
    #: The scope's in-process BM25 index. Its rows are all events seen (vector or not), in load order.
    lex_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    lex_ts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float64))
    lex_speakers: list[str | None] = field(default_factory=list)
    #: Event id -> row of the lexical index.
    lex_pos: dict[int, int] = field(default_factory=dict)
    doclen: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float64))
    #: word -> (rows, term frequencies), appended to as events arrive.
    postings: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


class ScopeIndexes:
    """The per-scope index cache of ``EpisodicMemory`` (a mixin: the memory holds the state named below)."""

    ts: TenantStore
    embedder: Embedder
    max_cached_vectors: int
    lazy_embed: int
    _cache: OrderedDict[str, _ScopeVectors]
    _cache_lock: threading.Lock

    def _vectors(self, scope: Scope) -> _ScopeVectors:
        with self._cache_lock:
            vec = self._cache.get(scope.key)
            if vec is None:
                vec = self._cache[scope.key] = _ScopeVectors()
            self._cache.move_to_end(scope.key)
        with vec.lock:
            if self._refresh(scope, vec):
                # Deletions: start over in a new object, so a search running on the old one in another
                # thread keeps a consistent (if stale) view; content is read from the store afterwards,
                # so a deleted event is still never returned.
                fresh = _ScopeVectors()
                with fresh.lock:
                    self._refresh(scope, fresh)
                with self._cache_lock:
                    self._cache[scope.key] = fresh
                vec = fresh
        self._evict()
        return vec

    def _refresh(self, scope: Scope, vec: _ScopeVectors) -> bool:
        """Add the scope's new events to ``vec``; True when events were deleted and it must be rebuilt.

        Searches read ``vec`` without its lock, so everything is appended in an order that keeps a
        reader safe: postings first, then the row arrays, then the array readers size themselves by
        (``doclen`` for BM25, ``matrix`` for cosine), and ``pos`` (id -> row of ``matrix``) last.
        """
        # Cheap when nothing changed: one pass over the scope's index (its count and highest id).
        # - Fewer events than seen, or a lower highest id (a rollback; a restored branch brings events back
        #   under their old ids): some were deleted. Rebuild, so no vector of a deleted event is ranked again.
        # - A higher id, or more events: read the new ones. If the count still differs from what was seen,
        #   events were also deleted meanwhile (as many as were written: an erasure or a rollback followed by
        #   new turns, perhaps on another host), or one committed after a higher id was read (PostgreSQL
        #   hands ids out before commit): rebuild as well.
        count, top = self.ts.events.extent(scope)
        if count < vec.seen or top < vec.max_id:  # (a lower highest id: a rollback or a branch restored)
            return True
        if top > vec.max_id or count > vec.seen:
            self._load_new(scope, vec, upto=top)
            if vec.seen != count:
                return True
        if vec.missing:
            self._fill_missing(scope, vec)
        return False

    def _load_new(self, scope: Scope, vec: _ScopeVectors, upto: int | None = None) -> None:
        """Add the scope's events after ``vec.max_id`` (up to ``upto``, the highest id its count was read with:
        one written since is left for the next refresh, so the two stay comparable)."""
        new = self.ts.events.list(scope, after_seq=vec.max_id, limit=10**9)
        if upto is not None:
            new = [e for e in new if e.id <= upto]
        if not new:
            return
        vec.seen += len(new)
        base = len(vec.lex_ids)
        lengths = []
        for n, e in enumerate(new):
            tf = Counter(_tokens(e.content))
            lengths.append(sum(tf.values()))
            vec.df.update(tf.keys())
            for w, c in tf.items():
                rows, tfs = vec.postings.setdefault(w, ([], []))
                rows.append(base + n)
                tfs.append(c)
        vec.lex_ids = np.concatenate([vec.lex_ids, np.array([e.id for e in new], dtype=np.int64)])
        vec.lex_ts = np.concatenate([vec.lex_ts, np.array([e.ts for e in new], dtype=np.float64)])
        vec.lex_speakers.extend(e.speaker for e in new)
        vec.lex_pos.update({e.id: base + n for n, e in enumerate(new)})
        vec.doclen = np.concatenate([vec.doclen, np.array(lengths, dtype=np.float64)])
        wanted = {e.id: e for e in new}
        since = min(e.ts for e in new)
        rows = [(i, b) for i, b in self.ts.events.embeddings(scope, since=since) if i in wanted]
        good = [(i, b) for i, b in rows if len(b) == DIMENSION * 4]
        if len(good) != len(rows):
            log.warning("ignoring embeddings of the wrong size", scope=scope.key, count=len(rows) - len(good))
        self._add_vectors(vec, good)
        have = {i for i, _ in rows}
        vec.missing.update(i for i in wanted if i not in have)
        vec.max_id = max(vec.max_id, max(wanted))

    def _fill_missing(self, scope: Scope, vec: _ScopeVectors) -> None:
        """Vectors of events seen without one: embedded since (in the background, by another host), or now.

        Embedding here is the fallback of a turn's deferred embedding (a host killed before it ran, a model
        error): the newest few are embedded and stored, so a search never misses a recent event for long.
        """
        ids = sorted(vec.missing)[-_MISSING_CHECK:]
        found = dict(self.ts.events.embeddings(scope, ids=ids))
        still = [i for i in ids if i not in found][-self.lazy_embed:] if self.lazy_embed > 0 else []
        if still:
            events = self.ts.events.get_many(scope, still)
            vectors = self.embedder.embed([e.content for e in events])
            rows = [(e.id, to_bytes(v)) for e, v in zip(events, vectors)]
            self.ts.events.put_embeddings(scope, rows)
            found.update(rows)
            vec.missing.difference_update(set(still) - {e.id for e in events})  # deleted meanwhile
        good = [(i, b) for i, b in found.items() if len(b) == DIMENSION * 4]
        vec.missing.difference_update(found)
        self._add_vectors(vec, good)

    @staticmethod
    def _add_vectors(vec: _ScopeVectors, good: list[tuple[int, bytes]]) -> None:
        """Append rows to the cosine matrix of events already in the lexical index (reader-safe order)."""
        good = [(i, b) for i, b in good if i in vec.lex_pos and i not in vec.pos]
        if not good:
            return
        rows = [vec.lex_pos[i] for i, _ in good]
        mat = np.frombuffer(b"".join(b for _, b in good), dtype="<f4").reshape(len(good), DIMENSION)
        base = len(vec.ids)
        need = base + len(good)
        if need > len(vec.room):
            # Grown by a quarter at a time: each vector is copied a bounded number of times on average, and the
            # spare room stays a small share of the cache (a few rows for a small scope: there may be many).
            grown = np.empty((max(need + 8, len(vec.room) * 5 // 4), DIMENSION), dtype=np.float32)
            grown[:base] = vec.matrix
            vec.room = grown
        vec.room[base:need] = mat
        vec.ids = np.concatenate([vec.ids, np.array([i for i, _ in good], dtype=np.int64)])
        vec.ts = np.concatenate([vec.ts, vec.lex_ts[rows]])
        vec.speakers.extend(vec.lex_speakers[r] for r in rows)
        vec.matrix = vec.room[:need]
        vec.pos.update({i: base + n for n, (i, _) in enumerate(good)})  # only rows ``matrix`` has

    def _drop(self, scope: Scope) -> None:
        with self._cache_lock:
            self._cache.pop(scope.key, None)

    def drop_cached(self, match: Callable[[str], bool]) -> None:
        """Forget the cached vectors of every scope whose key ``match`` accepts: after a deletion the event
        count cannot reveal (deleted, then as many written again, as a zero-retention agent does each turn)."""
        with self._cache_lock:
            for key in [k for k in self._cache if match(k)]:
                del self._cache[key]

    def _evict(self) -> None:
        with self._cache_lock:
            total = sum(len(v.ids) for v in self._cache.values())
            while len(self._cache) > 1 and total > self.max_cached_vectors:
                _, old = self._cache.popitem(last=False)
                total -= len(old.ids)
