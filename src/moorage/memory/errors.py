"""Typed errors of the memory part: missing embedding model, impossible budgets, bad datasets.

Each subclasses a shared ``moorage.errors`` type so the API and CLI map them without special cases.
"""

from __future__ import annotations

from moorage.errors import ConflictError, InvalidInput, NotFound, UnavailableError


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


class FactNotPending(ConflictError):
    """A confirmation or rejection of a fact that no longer waits for one (confirmed, rejected or never pending)."""

    code = "fact-not-pending"
    retryable = False

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
