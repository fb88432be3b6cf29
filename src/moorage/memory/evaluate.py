"""Retrieval evaluation: moorage's hybrid retriever against BM25 alone (rank-bm25) and dense alone, in one run.

Each conversation is ingested into a real store (one user scope each); recall@k and MRR are computed per system and question type.
"""

from __future__ import annotations

import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from moorage.config import Config
from moorage.memory.embeddings import Embedder, default_embedder
from moorage.memory.episodic import EpisodicMemory
from moorage.memory.evalset import QUESTION_TYPES, Dataset, parse_ts
from moorage.memory.ranking import FusionWeights
from moorage.store import EventIn, Scope, open_store

SYSTEMS = ("moorage", "bm25", "dense")
K_VALUES = (1, 5, 10)
_TOKEN = re.compile(r"\w+")


@dataclass
class Scores:
    n: int = 0
    hits: dict[int, float] = field(default_factory=lambda: {k: 0.0 for k in K_VALUES})
    rr: float = 0.0

    def add(self, ranked: Sequence[str], evidence: Sequence[str]) -> None:
        ev = set(evidence)
        self.n += 1
        for k in K_VALUES:
            self.hits[k] += len(ev & set(ranked[:k])) / len(ev)
        first = next((i for i, t in enumerate(ranked, start=1) if t in ev), None)
        self.rr += 1.0 / first if first else 0.0

    def as_dict(self) -> dict[str, float]:
        d = {f"recall@{k}": (self.hits[k] / self.n if self.n else 0.0) for k in K_VALUES}
        d["mrr"] = self.rr / self.n if self.n else 0.0
        d["questions"] = self.n
        return d


@dataclass
class EvalReport:
    dataset: str
    conversations: int
    turns: int
    questions: int
    systems: dict[str, dict[str, float]]
    by_type: dict[str, dict[str, dict[str, float]]]
    ingest_events_per_s: float
    bm25_version: str

    def as_dict(self) -> dict[str, object]:
        return self.__dict__.copy()


def _bm25_version() -> str:
    from importlib.metadata import version

    return version("rank-bm25")


def evaluate(
    ds: Dataset, *, embedder: Embedder | None = None, weights: FusionWeights = FusionWeights(),
    work_dir: Path | None = None, progress: Callable[[str], None] | None = None,
) -> EvalReport:
    from rank_bm25 import BM25Okapi

    embedder = embedder or default_embedder()
    scores = {s: Scores() for s in SYSTEMS}
    typed = {(s, t): Scores() for s in SYSTEMS for t in QUESTION_TYPES}
    ingest_s = 0.0
    turns_total = 0
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        store = open_store(Config(data_dir=Path(tmp)))
        try:
            tenant, _ = store.operator.create_tenant("memory-eval")
            ts = store.tenant(store.operator.principal(tenant.id))
            mem = EpisodicMemory(ts, embedder, weights=weights)
            for conv in ds.conversations:
                scope = Scope.for_user("eval", conv.user)
                turns = conv.turns()
                turns_total += len(turns)
                t0 = time.perf_counter()
                events = mem.remember_many(scope, [
                    EventIn("message", t.text, t.speaker, {"turn": t.id}, parse_ts(t.ts, t.id)) for t in turns
                ])
                ingest_s += time.perf_counter() - t0
                turn_of = {e.id: t.id for e, t in zip(events, turns)}
                times = np.array([e.ts for e in events])
                corpus = [[w.lower() for w in _TOKEN.findall(t.text)] for t in turns]
                for q in conv.questions:
                    asked = parse_ts(q.asked_at, q.id)
                    visible = np.flatnonzero(times <= asked)
                    bm25 = BM25Okapi([corpus[i] for i in visible])
                    bscores = bm25.get_scores([w.lower() for w in _TOKEN.findall(q.question)])
                    order = np.argsort(-bscores, kind="stable")[:10]
                    ranked = {
                        "bm25": [turns[visible[i]].id for i in order],
                        "dense": [turn_of[i] for i, _ in mem.search_dense(scope, q.question, limit=10, until=asked)],
                        "moorage": [turn_of[h.event.id] for h in mem.search(scope, q.question, k=10, until=asked)],
                    }
                    for s in SYSTEMS:
                        scores[s].add(ranked[s], q.evidence)
                        typed[(s, q.type)].add(ranked[s], q.evidence)
                if progress:
                    progress(f"{conv.id}: {len(turns)} turns, {len(conv.questions)} questions")
        finally:
            store.close()
    return EvalReport(
        dataset=ds.name,
        conversations=len(ds.conversations),
        turns=turns_total,
        questions=sum(len(c.questions) for c in ds.conversations),
        systems={s: scores[s].as_dict() for s in SYSTEMS},
        by_type={t: {s: typed[(s, t)].as_dict() for s in SYSTEMS} for t in QUESTION_TYPES if typed[("moorage", t)].n},
        ingest_events_per_s=turns_total / ingest_s if ingest_s else 0.0,
        bm25_version=_bm25_version(),
    )
