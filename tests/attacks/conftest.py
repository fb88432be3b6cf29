"""Fixtures of the attack suite: a runtime per sandbox driver with the hostile agent deployed, and a sampler
of the host process's resident memory (the bound every attack states).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from typing import AsyncIterator

from moorage.memory.embeddings import MAX_BATCH_TOKENS, MAX_TOKENS, default_embedder
from moorage.store import EntityKey
from tests.attacks.hostile_agent import AGENT
from tests.runtime.conftest import Env, make_env, write_agent

MiB = 1 << 20
_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class RssWatch:
    """Samples this process's RSS every few ms while active; ``growth`` is the peak above the start."""

    def __init__(self) -> None:
        self.start = rss_bytes()
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.005)

    def __enter__(self) -> "RssWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def growth(self) -> int:
        return self.peak - self.start


class Hostile:
    """The runtime, the hostile agent's entity and a bystander instance of the same deployment."""

    def __init__(self, env: Env, driver: str) -> None:
        self.env = env
        self.driver = driver
        self.attacker = EntityKey("hostile", "mallory")
        self.bystander = EntityKey("hostile", "bystander")

    async def say(self, message: str, who: EntityKey | None = None) -> str:
        r = await self.env.runtime.invoke(self.env.principal, who or self.attacker, message)
        return str(r.reply)

    async def settle(self) -> None:
        """Turns until the host's memory is steady: its first turns load models (embeddings) once, which is no
        attack's doing and would otherwise be counted against the first attack measured."""
        await self.say("recall warm up")  # a memory search loads the host's embedding model now
        # ...and one run of full-length texts takes its working memory to the bound it keeps for reuse (~140 MiB,
        # MAX_BATCH_TOKENS): embedding a later turn's long reply would otherwise grow the host during an attack.
        embedder = self.env.runtime.embedder or default_embedder()
        await asyncio.to_thread(embedder.embed, ["warm " * MAX_TOKENS] * (MAX_BATCH_TOKENS // MAX_TOKENS))
        last = rss_bytes()
        steady = 0
        for _ in range(40):
            assert await self.say("ping") == "pong"
            await asyncio.sleep(0.5)
            now = rss_bytes()
            steady = steady + 1 if abs(now - last) < 2 * MiB else 0
            last = now
            if steady >= 3:
                await self.quiet()
                return

    async def quiet(self) -> None:
        """Wait for the host's background work of earlier turns (embedding their messages) to finish."""
        # A turn's reply goes out before its checkpoint, and its messages are queued for embedding only after
        # that: first wait for the turns still finishing, or their embedding lands inside the next measurement.
        for _ in range(600):
            if not self.env.runtime.turns:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"turns still running: {list(self.env.runtime.turns)}")
        queue = getattr(self.env.runtime, "embed_queue", None)
        if queue is not None:
            await asyncio.to_thread(queue.wait_idle, 60)

    async def measured(self) -> RssWatch:
        """An RSS watch to wrap one attack in, started once earlier turns' background work is done."""
        await self.quiet()
        return RssWatch()

    async def sandbox(self, who: EntityKey | None = None):  # type: ignore[no-untyped-def]
        """The running sandbox of ``who`` (attacker by default)."""
        from moorage.store import Scope

        who = who or self.attacker
        ts = self.env.store.tenant(self.env.principal)
        rec = ts.sandboxes.for_scope(Scope.for_user(who.agent, who.user))
        return await self.env.runtime.driver.open(rec.id)


async def hostile_env(tmp: Path, driver: str) -> AsyncIterator[Hostile]:
    async for env in make_env(tmp, driver):
        await env.runtime.deploy(env.principal, write_agent(tmp / "hostile-agent", "hostile", AGENT))
        h = Hostile(env, driver)
        assert await h.say("ping") == "pong"
        assert await h.say("ping", h.bystander) == "pong"
        await h.settle()
        yield h
