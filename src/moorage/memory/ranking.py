"""Fusion of lexical and dense rankings for hybrid episodic retrieval, with temporal-intent-aware recency.

Pure functions over scores keyed by event id, so the evaluation and the retriever share them exactly.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Literal, Mapping

Method = Literal["convex", "rrf"]


@dataclass(frozen=True)
class FusionWeights:
    """How lexical and dense evidence combine.

    ``convex`` (default): ``dense * norm(cosine) + (1 - dense) * norm(bm25)``, each normalised over the
    candidate pool, plus ``recency * 2^(-age / half_life)``. Bruch et al. (2023, "An analysis of fusion
    functions for hybrid retrieval") find this beats reciprocal rank fusion, and it does here too: RRF
    credits a weak lexical match on one common word like a real match, which convex scores do not.
    ``rrf``: ``Σ 1 / (k + rank)`` over both lists (Cormack et al., 2009), kept for comparison.
    """

    method: Method = "convex"
    #: Share of the dense score in the convex combination.
    dense: float = 0.7
    k: float = 60.0
    recency: float = 0.05
    half_life_s: float = 30 * 86400.0
    #: Multiplies ``recency`` for queries that ask for the current value ("now", "these days").
    current_boost: float = 3.0
    #: "... before X": weight of the event naming X added to the query vector (0: no anchoring).
    anchor: float = 1.0
    #: Subtracted from turns not by ``self_speaker`` when the query is in the first person.
    other_speaker_penalty: float = 0.3
    self_speaker: str = "user"


_CURRENT = re.compile(r"\b(?:now|current(?:ly)?|these days|at the moment|today|latest|still|any ?more|nowadays)\b", re.I)
_PAST = re.compile(
    r"\b(?:before|previous(?:ly)?|used to|earlier|formerly|old|first|originally|ago|last time|back when|ever|every|all|"
    r"so far|over time|history)\b",
    re.I,
)


def temporal_intent(query: str) -> str:
    """``current`` (asks for the latest value), ``past`` (asks for older or all values) or ``neutral``.

    Recency is good evidence for the first and bad for the second: "where did I live before X?" is
    answered by an older turn that a recency bonus would push down.
    """
    if _PAST.search(query):
        return "past"
    if _CURRENT.search(query):
        return "current"
    return "neutral"


def weights_for(query: str, weights: FusionWeights) -> FusionWeights:
    intent = temporal_intent(query)
    if intent == "past":
        return replace(weights, recency=0.0)
    if intent == "current":
        return replace(weights, recency=weights.recency * weights.current_boost)
    return weights


def fuse(
    lexical: Mapping[int, float],
    dense: Mapping[int, float],
    timestamps: Mapping[int, float],
    weights: FusionWeights = FusionWeights(),
    *,
    now: float | None = None,
) -> list[tuple[int, float]]:
    """Combine lexical scores (higher is better) and cosine similarities into one ranking, best first.

    ``lexical`` and ``dense`` map event id to score, in rank order for RRF. Ids only in ``lexical``
    count as cosine 0 unless the caller supplies their cosine (the retriever does: it has every vector).
    """
    ids = set(lexical) | set(dense)
    if not ids:
        return []
    scores: dict[int, float] = {}
    if weights.method == "rrf":
        for rank, i in enumerate(lexical, start=1):
            scores[i] = scores.get(i, 0.0) + 1.0 / (weights.k + rank)
        for rank, i in enumerate(dense, start=1):
            scores[i] = scores.get(i, 0.0) + 1.0 / (weights.k + rank)
    else:
        cos = {i: dense.get(i, 0.0) for i in ids}
        hi, lo = max(cos.values()), min(cos.values())
        top_lex = max(lexical.values(), default=0.0)
        for i in ids:
            d = (cos[i] - lo) / (hi - lo) if hi > lo else 1.0
            lx = lexical.get(i, 0.0) / top_lex if top_lex > 0 else 0.0
            scores[i] = weights.dense * d + (1.0 - weights.dense) * lx
    if weights.recency:
        ref = now if now is not None else max(timestamps.get(i, 0.0) for i in ids)
        bonus_scale = 1.0 if weights.method == "convex" else 1.0 / (weights.k + 1)
        for i in ids:
            age = max(0.0, ref - timestamps.get(i, ref))
            scores[i] += weights.recency * bonus_scale * math.pow(2.0, -age / weights.half_life_s)
    # Ties: the newer event (higher id) first, so equal evidence resolves to the current value.
    return sorted(scores.items(), key=lambda kv: (-kv[1], -kv[0]))
