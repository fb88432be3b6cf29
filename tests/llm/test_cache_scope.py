"""The embedded model's prompt cache is partitioned by tenant: the slot table on its own, then the real
gateway and engine (complete and stream) with two tenants sending the same prompt."""

from __future__ import annotations

import threading
import uuid

from moorage.llm import ChatRequest, EmbeddedProvider, InMemoryUsageSink, LLMGateway, Message, collect
from moorage.llm._engine import SlotTable


def test_a_slot_is_reused_only_by_the_scope_that_filled_it() -> None:
    t = SlotTable(2)
    a = t.acquire("a")
    assert (a.slot, a.reuse) == (0, False)
    t.release(a)
    b = t.acquire("b")
    assert (b.slot, b.reuse) == (1, False)  # a free slot nobody used, not a's
    t.release(b)
    a2 = t.acquire("a")
    assert (a2.slot, a2.reuse) == (0, True)  # its own slot, cache and all
    t.release(a2)
    c = t.acquire("c")
    assert (c.slot, c.reuse) == (1, False)  # the least recently used slot, recomputed for c
    t.release(c)
    assert t.owners() == ("a", "c")
    b2 = t.acquire("b")
    assert (b2.slot, b2.reuse) == (0, False)  # b's tokens were overwritten by c; a's slot is the LRU one now
    t.release(b2)
    assert t.owners() == ("b", "c")


def test_a_leased_slot_is_never_shared() -> None:
    t = SlotTable(2)
    held = [t.acquire("a"), t.acquire("a")]
    assert sorted(h.slot for h in held) == [0, 1]
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(t.acquire("b")))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and not got, "a third request must wait for a slot, not share one"
    t.release(held[1])
    waiter.join(10)
    assert not waiter.is_alive()
    [lease] = got
    assert lease.slot == held[1].slot and not lease.reuse  # type: ignore[attr-defined]


async def test_tenants_sending_the_same_prompt_share_no_cache() -> None:
    usage = InMemoryUsageSink()
    gateway = LLMGateway([EmbeddedProvider()], usage_sink=usage)
    t1, t2 = f"t1-{uuid.uuid4().hex[:8]}", f"t2-{uuid.uuid4().hex[:8]}"
    req = ChatRequest([Message.system("You answer questions about the solar system, briefly and exactly."),
                       Message.user("Which planet is closest to the sun?")], max_tokens=2, temperature=0)
    try:
        first = await gateway.complete(t1, req)
        other = await collect(gateway.stream(t2, req))  # the same prompt, right after, from another tenant
        again = await gateway.complete(t1, req)
        other_again = await gateway.complete(t2, req)
    finally:
        await gateway.aclose()
    assert first.usage.cached_input_tokens == 0
    assert other.usage is not None and other.usage.cached_input_tokens == 0
    assert other.usage.input_tokens == first.usage.input_tokens  # all of it computed afresh
    assert again.usage.cached_input_tokens > 0  # each tenant still hits its own cache
    assert other_again.usage.cached_input_tokens > 0
    assert [r.cached_input_tokens for r in usage.for_tenant(t2)] == [0, other_again.usage.cached_input_tokens]
