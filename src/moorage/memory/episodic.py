"""Episodic memory: the time-ordered event log of a scope, embedded on write or soon after, searched hybrid.

Lexical (the store's full-text search) and dense (exact cosine over one scope's vectors) rankings are fused and re-ranked by recency.
"""

from __future__ import annotations

import re
import threading
from collections import Counter, OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from moorage.errors import InvalidInput
from moorage.log import get_logger
from moorage.memory.embeddings import DIMENSION, Embedder, default_embedder, to_bytes
from moorage.memory.ranking import FusionWeights, fuse, weights_for
from moorage.store import Event, EventIn, Scope, TenantStore

log = get_logger(__name__)

_WORD = re.compile(r"[A-Za-z0-9]+")
# Words that carry no topic: dropping them keeps full-text queries selective (and fast on big logs).
_QUERY_STOP = frozenset(
    "a an the and or but if of in on at for with from by as is are was were be been it its this that these those "
    "i me my mine you your he she his her we our they their them what which who whom whose how when where why "
    "do does did done doing have has had can could would should will shall may might must not no to about into "
    "than then there here any some all ever again still now currently "
    # Temporal phrasing says *which* value is wanted (handled by recency), not what it is about.
    "these days today moment time far before previously used lately recently usually over".split()
)


#: A question in the first person is about the user.
_FIRST_PERSON = re.compile(r"\b(?:i|me|my|mine|myself|i'm|i've)\b", re.I)

#: "... before <the event that changed it>": the words after it name the anchor event.
_BEFORE = re.compile(r"\bbefore\b(.+)$", re.I)

#: Events with the anchor's words considered as the anchor.
_ANCHOR_CANDIDATES = 10

#: BM25 parameters (Robertson's defaults, as in rank-bm25 and Lucene).
_BM25_K1 = 1.2
_BM25_B = 0.75


def _tokens(text: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(text)]


def _narrowed(mask: np.ndarray, ts: np.ndarray, speaker_of: Sequence[str | None], since: float | None,
              until: float | None, speakers: Sequence[str] | None) -> np.ndarray:
    """``mask`` (one flag per row) keeping only rows stamped within [since, until] and said by one of
    ``speakers``; ``ts`` and ``speaker_of`` give each row's time and speaker."""
    if since is not None:
        mask &= ts >= since
    if until is not None:
        mask &= ts <= until
    if speakers:
        allowed = set(speakers)
        n = len(mask)
        mask &= np.fromiter((s in allowed for s in speaker_of[:n]), dtype=bool, count=n)
    return mask


def _query_words(query: str) -> list[str]:
    words = list(dict.fromkeys(w for w in _tokens(query) if w not in _QUERY_STOP))
    return words or list(dict.fromkeys(_tokens(query)))


#: Events seen without a vector whose vectors one refresh looks up (the newest of them).
_MISSING_CHECK = 512

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


@dataclass(frozen=True)
class _Anchor:
    event_id: int
    row: int
    words: frozenset[str]


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


class EpisodicMemory:
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

    @staticmethod
    def _times(vec: _ScopeVectors, ids: set[int]) -> dict[int, float]:
        known = [i for i in ids if i in vec.lex_pos]
        return dict(zip(known, vec.lex_ts[[vec.lex_pos[i] for i in known]].tolist()))

    def search_lexical(
        self, scope: Scope, query: str, *, limit: int = 50, since: float | None = None, until: float | None = None,
        speakers: Sequence[str] | None = None,
    ) -> list[tuple[Event, float]]:
        vec = self._vectors(scope)
        return self._lexical(scope, vec, query, limit=limit, since=since, until=until, speakers=speakers)

    def _anchor(
        self, vec: _ScopeVectors, query: str, qv: np.ndarray, *, since: float | None, until: float | None,
        speakers: Sequence[str] | None,
    ) -> _Anchor | None:
        """The event that ``before X`` in ``query`` refers to, if the scope has one.

        Candidates are the events with X's words (BM25); of those, the one closest to the whole question
        wins: "I joined Hooli" is what "before joining Hooli" points at, "Hooli is hiring" is not.
        """
        m = _BEFORE.search(query)
        if not m:
            return None
        words = [w for w in _query_words(m.group(1)) if w in vec.postings]
        if not words:
            return None
        hits = self._bm25(vec, words, limit=_ANCHOR_CANDIDATES, since=since, until=until, speakers=speakers)
        if not hits:
            return None
        best = max(hits, key=lambda h: float(vec.matrix[vec.pos[h[0]]] @ qv) if h[0] in vec.pos else -2.0)
        return _Anchor(best[0], vec.lex_pos[best[0]], frozenset(words))

    @staticmethod
    def _prefer_speaker(
        vec: _ScopeVectors, fused: list[tuple[int, float]], speaker: str, penalty: float,
    ) -> list[tuple[int, float]]:
        out = []
        for i, sc in fused:
            row = vec.lex_pos.get(i)
            if row is not None and vec.lex_speakers[row] != speaker:
                sc -= penalty
            out.append((i, sc))
        return sorted(out, key=lambda kv: (-kv[1], -kv[0]))

    @staticmethod
    def _bm25(
        vec: _ScopeVectors, words: Sequence[str], *, limit: int, since: float | None, until: float | None,
        speakers: Sequence[str] | None,
    ) -> list[tuple[int, float]]:
        """Okapi BM25 over the scope's in-process index: (event id, score) best first, only positive scores.

        Why not the store's full-text search: it spans the whole tenant, so it must join every match to
        its row to check the scope and compute bm25 for matches of other users too (5-9 ms at 10k
        events, 100+ ms at 100k). Here the postings are the scope's own, the statistics (document
        frequency, average length) are the scope's own, and scoring is a few array operations.
        """
        # A snapshot: rows past ``len(doclen)`` may be half-added by a concurrent refresh; ignore them.
        doclen = vec.doclen
        n_docs = len(doclen)
        if n_docs == 0:
            return []
        lex_ids, lex_ts = vec.lex_ids[:n_docs], vec.lex_ts[:n_docs]
        avgdl = float(doclen.mean()) or 1.0
        norm = _BM25_K1 * (1.0 - _BM25_B + _BM25_B * doclen / avgdl)
        scores = np.zeros(n_docs, dtype=np.float64)
        for w in words:
            post = vec.postings.get(w)
            if not post:
                continue
            m = min(len(post[0]), len(post[1]))
            rows = np.asarray(post[0][:m], dtype=np.int64)
            tf = np.asarray(post[1][:m], dtype=np.float64)
            keep = int(np.searchsorted(rows, n_docs))  # rows of a word only grow
            rows, tf = rows[:keep], tf[:keep]
            df = len(rows)
            if df == 0:
                continue
            idf = np.log1p((n_docs - df + 0.5) / (df + 0.5))
            scores[rows] += idf * tf * (_BM25_K1 + 1.0) / (tf + norm[rows])
        hit = np.flatnonzero(_narrowed(scores > 0, lex_ts, vec.lex_speakers, since, until, speakers))
        if len(hit) == 0:
            return []
        if len(hit) > limit:
            hit = hit[np.argpartition(-scores[hit], limit - 1)[:limit]]
        # Best first; ties to the newer event, like the store's ``ORDER BY score DESC, id DESC``.
        hit = hit[np.lexsort((-lex_ids[hit], -scores[hit]))]
        return [(int(lex_ids[r]), float(scores[r])) for r in hit]

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

    @staticmethod
    def _dense(
        vec: _ScopeVectors, q: np.ndarray, *, limit: int, since: float | None, until: float | None,
        speakers: Sequence[str] | None,
    ) -> list[tuple[int, float]]:
        # A snapshot sized by ``matrix``, which a concurrent refresh replaces after the other arrays.
        matrix = vec.matrix
        n_rows = len(matrix)
        if n_rows == 0:
            return []
        ids, ts = vec.ids[:n_rows], vec.ts[:n_rows]
        # einsum's own loop, not BLAS: OpenBLAS threads spin-wait on a busy host and made this
        # matrix-vector product 10x slower (8 ms vs 0.6 ms at 10k vectors, measured on 2 shared cores).
        sims = np.einsum("ij,j->i", matrix, q)
        mask = _narrowed(np.ones(n_rows, dtype=bool), ts, vec.speakers, since, until, speakers)
        sims = np.where(mask, sims, -np.inf)
        n = min(limit, int(mask.sum()))
        if n == 0:
            return []
        top = np.argpartition(-sims, n - 1)[:n] if n < len(sims) else np.arange(len(sims))
        top = top[np.argsort(-sims[top], kind="stable")]
        return [(int(ids[i]), float(sims[i])) for i in top]

    # -- the per-scope vector cache ------------------------------------------------------------

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
