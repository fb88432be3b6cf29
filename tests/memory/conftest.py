"""Fixtures for memory tests; the store fixtures (``store``, ``tenant``, ``other_tenant``) come from tests/conftest.py."""

from __future__ import annotations

import pytest

from moorage.memory.embeddings import Embedder, default_embedder


@pytest.fixture(scope="session")
def embedder() -> Embedder:
    return default_embedder()
