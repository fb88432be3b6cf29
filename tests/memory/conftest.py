"""Fixtures for memory tests; the store fixtures (``store``, ``tenant``, ``other_tenant``) come from tests/conftest.py."""

from __future__ import annotations

import pytest

from moorage.memory.embeddings import Embedder, default_embedder


@pytest.fixture(scope="session")
def embedder() -> Embedder:
    return default_embedder()


# A real runtime and server for the tests of ctx.memory (the API suite's fixtures).
from tests.api.conftest import acme, live_rt, runtime  # noqa: E402, F401  (fixtures)
