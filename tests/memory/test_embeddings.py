"""The local MiniLM embedder: unit vectors, batch-independent results, meaningful similarity, byte layout."""

from __future__ import annotations

import numpy as np

import threading
import time

from moorage.memory.embeddings import DIMENSION, MAX_BATCH_TOKENS, MAX_TOKENS, Embedder, from_bytes, to_bytes
from moorage.memory.tokens import ApproxTokenCounter, MiniLMTokenCounter


def test_vectors_are_unit_length_and_independent_of_batching(embedder: Embedder) -> None:
    texts = ["My cat is called Tom.", "short", "A much longer sentence about quarterly budgets and travel plans " * 3]
    batch = embedder.embed(texts)
    assert batch.shape == (3, DIMENSION) and batch.dtype == np.float32
    assert np.allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-5)
    for i, t in enumerate(texts):
        assert np.allclose(embedder.embed_one(t), batch[i], atol=1e-5)  # padding in a batch changes nothing
    assert embedder.embed([]).shape == (0, DIMENSION)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_long_texts_are_embedded_within_a_token_budget_per_model_run(embedder: Embedder) -> None:
    # The guest chooses the text: 32 full-length texts in one run took 750 MiB of host memory, kept by the model
    # for reuse. Each run stays within MAX_BATCH_TOKENS padded tokens; short texts still go many at a time.
    fresh = Embedder()  # its own model session, so its memory peak is this test's
    fresh.embed(["warm"])
    runs: list[tuple[int, int]] = []
    real_run = fresh._run

    def spy(enc):  # type: ignore[no-untyped-def]
        runs.append((len(enc), max(len(e.ids) for e in enc)))
        return real_run(enc)

    fresh._run = spy  # type: ignore[method-assign]
    long = [f"text {i} " + "many words about everything " * 120 for i in range(32)]
    short = [f"note {i}: the cat is called Tom" for i in range(40)]
    start, peak, done = _rss(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        got = fresh.embed(long + short)
    finally:
        done.set()
        sampler.join()
    assert all(count * width <= MAX_BATCH_TOKENS for count, width in runs), runs
    assert max(width for _, width in runs) == MAX_TOKENS  # long texts are cut at the model's length
    assert max(count for count, width in runs if width < 20) == 32  # short ones are not held to the long ones' pace
    assert peak[0] - start < 300 << 20, (peak[0] - start) >> 20  # unbounded: ~750 MiB
    for i in (0, 31, 32, 71):
        assert np.allclose(embedder.embed_one((long + short)[i]), got[i], atol=1e-5)


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
