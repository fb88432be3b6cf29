"""Agent memory: working (context builder), episodic (event log + hybrid retrieval), semantic (facts).

Public API re-exported here; every search runs inside one tenant-scoped store handle and one scope.
"""

from moorage.memory.context import CompactionPolicy, ContextBuilder, Message, ModelInput
from moorage.memory.embeddings import Embedder, default_embedder
from moorage.memory.summarize import ExtractiveSummarizer, Summarizer
from moorage.memory.tokens import ApproxTokenCounter, MiniLMTokenCounter, TokenCounter

__all__ = [
    "ApproxTokenCounter",
    "CompactionPolicy",
    "ContextBuilder",
    "Embedder",
    "ExtractiveSummarizer",
    "Message",
    "MiniLMTokenCounter",
    "ModelInput",
    "Summarizer",
    "TokenCounter",
    "default_embedder",
]
