"""Agent memory: working (context builder), episodic (event log + hybrid retrieval), semantic (facts).

Public API re-exported here; every search runs inside one tenant-scoped store handle and one scope.
"""

from moorage.memory.context import CompactionPolicy, ContextBuilder, Message, ModelInput
from moorage.memory.embeddings import Embedder, default_embedder
from moorage.memory.episodic import EpisodicMemory, Recall
from moorage.memory.extraction import FactCandidate, FactExtractor, PatternExtractor
from moorage.memory.ranking import FusionWeights
from moorage.memory.semantic import FactChange, SemanticMemory, TurnRef
from moorage.memory.summarize import ExtractiveSummarizer, Summarizer
from moorage.memory.tokens import ApproxTokenCounter, MiniLMTokenCounter, TokenCounter

__all__ = [
    "ApproxTokenCounter",
    "CompactionPolicy",
    "ContextBuilder",
    "Embedder",
    "EpisodicMemory",
    "FactCandidate",
    "FactChange",
    "FactExtractor",
    "FusionWeights",
    "PatternExtractor",
    "Recall",
    "SemanticMemory",
    "ExtractiveSummarizer",
    "Message",
    "MiniLMTokenCounter",
    "ModelInput",
    "Summarizer",
    "TokenCounter",
    "TurnRef",
    "default_embedder",
]
