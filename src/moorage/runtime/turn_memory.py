"""The memory tiers as ``Runtime`` uses them in a turn: each tenant's episodic and semantic memory, the session's
working memory (the model input built for the turn, written back with its reply), and the cache dropped after a purge."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moorage.runtime.host_calls import TurnBinding
from moorage.store import TenantStore


@dataclass
class _Memory:
    episodic: Any
    semantic: Any


class TurnMemory:
    """``Runtime``'s memory tiers per tenant and a turn's working memory (a part of it: it reads the runtime's config,
    store, model gateway and embedder)."""

    def memory(self, ts: TenantStore) -> _Memory:
        m = self._memories.get(ts.tenant_id)
        if m is None:
            from moorage.memory import EpisodicMemory, SemanticMemory, default_embedder

            extractor = None
            if self.config.memory_extractor == "model":
                from moorage.memory.llm_backed import GatewayFactExtractor

                extractor = GatewayFactExtractor(self.llm, ts.tenant_id, lambda: self._loop)
            m = self._memories[ts.tenant_id] = _Memory(EpisodicMemory(ts, self.embedder or default_embedder()),
                                                        SemanticMemory(ts, extractor))
        return m

    def _writer(self, ts: TenantStore) -> _Memory:
        """The tenant's memory tiers bound to ``ts`` itself, so their writes join a transaction open on it."""
        from moorage.memory import EpisodicMemory, SemanticMemory

        m = self.memory(ts)
        return _Memory(EpisodicMemory(ts, m.episodic.embedder), SemanticMemory(ts, m.semantic.extractor))

    def _summarizer(self, b: TurnBinding) -> Any:
        if self.config.memory_summarizer != "model":
            return None  # the context builder's offline extractive summarizer
        from moorage.memory.llm_backed import GatewaySummarizer

        return GatewaySummarizer(self.llm, b.ts.tenant_id, lambda: self._loop,
                                 entity={"agent": b.entity.agent, "user": b.entity.user})

    def working_memory_input(self, b: TurnBinding, message: str, system: str, tools: list[dict[str, Any]]) -> list[dict[str, str]]:
        """Model input for this turn from the session's context builder (stable prefix + append-only tail).

        The updated builder is kept with the turn and written with its result (``_save_working_memory``): a
        turn that never finishes leaves working memory as it was, so its retry adds the message once.
        """
        from moorage.memory import ContextBuilder

        scope = b.session_scope
        builder = ContextBuilder(system or "", tools, summarizer=self._summarizer(b))
        held = self._working.get(b.turn_id)
        if held is not None:
            builder.restore(held[0])
            version = held[1]
        else:
            rec = b.ts.state.get(scope, "working_memory")
            if rec is not None:
                builder.restore(rec.value)
            version = rec.version if rec else 0
        facts = self.memory(b.ts).semantic.recall(b.user_scope)
        note = "; ".join(f.text or f"{f.subject} {f.attribute}: {f.value}" for f in facts[-12:])
        # Known facts ride in the new user turn, never in the prefix, so the prefix stays byte-identical.
        builder.add("user", f"[known about the user: {note}]\n{message}" if note else message)
        out = builder.build()
        self._working[b.turn_id] = (builder.to_state(), version)
        return [m if isinstance(m, dict) else m.to_dict() for m in out.messages]

    def _remember_reply(self, b: TurnBinding, reply: Any) -> None:
        """Write the turn's working memory with the reply appended (inside the turn's last transaction)."""
        from moorage.memory import ContextBuilder

        held = self._working.pop(b.turn_id, None)
        if held is None:
            rec = b.ts.state.get(b.session_scope, "working_memory")
            if rec is None or not isinstance(reply, str):
                return
            held = (rec.value, rec.version)
        builder = ContextBuilder("", [])
        builder.restore(held[0])
        if isinstance(reply, str):
            builder.add("assistant", reply)
        b.ts.state.put(b.session_scope, "working_memory", builder.to_state(), expected_version=held[1])

    def drop_cached_vectors(self, ts: TenantStore, agent: str, user: str | None = None) -> None:
        """After a purge: the episodic cache of the user's (or every user's) scopes of ``agent`` is stale in a
        way its event count may not show."""
        m = self._memories.get(ts.tenant_id)
        if m is not None:
            if user is None:
                m.episodic.drop_cached(lambda key: key.startswith((f"user:{agent}/", f"session:{agent}/")))
            else:
                m.episodic.drop_cached(lambda key: key == f"user:{agent}/{user}" or key.startswith(f"session:{agent}/{user}/"))
