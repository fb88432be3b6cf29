"""Typed errors of the memory part: missing embedding model, impossible budgets, bad datasets.

Each subclasses a shared ``moorage.errors`` type so the API and CLI map them without special cases.
"""

from __future__ import annotations

from moorage.errors import InvalidInput, NotFound, UnavailableError


class EmbeddingModelUnavailable(UnavailableError):
    """The local MiniLM ONNX model or its tokenizer cannot be found or loaded."""

    code = "embedding-model-unavailable"


class ContextBudgetError(InvalidInput):
    """A model call cannot fit its hard token budget even after compaction."""

    code = "context-budget"


class DatasetError(InvalidInput):
    """An evaluation dataset file is missing, malformed or inconsistent."""

    code = "memory-dataset"


class FactNotFound(NotFound):
    code = "fact-not-found"
