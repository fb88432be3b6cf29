"""Rank fusion and recency re-ranking for hybrid episodic retrieval, as pure functions over ranked id lists.

Kept apart from I/O so the evaluation can run the same fusion over its own BM25 and dense rankings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence


@dataclass(frozen=True)
class FusionWeights:
    """Reciprocal rank fusion ``Σ w / (k + rank)`` plus a mild recency factor.

    ``k`` = 60 is the constant from Cormack et al. (2009); it flattens the head so that one list's
    first hit cannot drown agreement between both lists. Recency multiplies the fused score by
    ``1 + recency * 2^(-age / half_life)``, so newer evidence wins ties (current values) without
    hiding older evidence that matches much better (history questions).
    """

    k: float = 60.0
    lexical: float = 1.0
    dense: float = 1.0
    recency: float = 0.25
    half_life_s: float = 30 * 86400.0


def fuse(
    lexical: Sequence[int],
    dense: Sequence[int],
    timestamps: Mapping[int, float],
    weights: FusionWeights = FusionWeights(),
    *,
    now: float | None = None,
) -> list[tuple[int, float]]:
    """Fuse two ranked id lists (best first) into one ranking of ``(id, score)``, best first."""
    scores: dict[int, float] = {}
    for rank, i in enumerate(lexical, start=1):
        scores[i] = scores.get(i, 0.0) + weights.lexical / (weights.k + rank)
    for rank, i in enumerate(dense, start=1):
        scores[i] = scores.get(i, 0.0) + weights.dense / (weights.k + rank)
    if weights.recency and scores:
        ref = now if now is not None else max(timestamps.get(i, 0.0) for i in scores)
        for i in scores:
            age = max(0.0, ref - timestamps.get(i, ref))
            scores[i] *= 1.0 + weights.recency * math.pow(2.0, -age / weights.half_life_s)
    # Ties: the newer event (higher id) first, so equal evidence resolves to the current value.
    return sorted(scores.items(), key=lambda kv: (-kv[1], -kv[0]))
