"""The local MiniLM embedder: unit vectors, batch-independent results, meaningful similarity, byte layout."""

from __future__ import annotations

import numpy as np

from moorage.memory.embeddings import DIMENSION, Embedder, from_bytes, to_bytes
from moorage.memory.tokens import ApproxTokenCounter, MiniLMTokenCounter


def test_vectors_are_unit_length_and_independent_of_batching(embedder: Embedder) -> None:
    texts = ["My cat is called Tom.", "short", "A much longer sentence about quarterly budgets and travel plans " * 3]
    batch = embedder.embed(texts)
    assert batch.shape == (3, DIMENSION) and batch.dtype == np.float32
    assert np.allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-5)
    for i, t in enumerate(texts):
        assert np.allclose(embedder.embed_one(t), batch[i], atol=1e-5)  # padding in a batch changes nothing
    assert embedder.embed([]).shape == (0, DIMENSION)


def test_paraphrases_are_closer_than_unrelated_text(embedder: Embedder) -> None:
    a, b, c = embedder.embed(["We adopted a kitten named Miso.", "My cat is called Miso.", "The invoice is overdue."])
    assert float(a @ b) > float(a @ c) + 0.3


def test_vector_bytes_round_trip_as_float32_little_endian(embedder: Embedder) -> None:
    v = embedder.embed_one("hello")
    blob = to_bytes(v)
    assert len(blob) == DIMENSION * 4
    assert np.array_equal(from_bytes(blob), v)


def test_token_counters() -> None:
    assert MiniLMTokenCounter().count("hello world") == 2
    assert ApproxTokenCounter().count("x" * 9) == 3
