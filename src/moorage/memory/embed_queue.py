"""The background embedding of events written without a vector: one thread per host, soon after each turn.

A turn commits its messages unembedded (the reply does not wait for the model); this embeds them right after.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from typing import TYPE_CHECKING

from moorage.log import get_logger

if TYPE_CHECKING:
    from moorage.memory.episodic import EpisodicMemory

log = get_logger(__name__)

#: The worker thread's name (tests tell its commits from the turn's by it).
THREAD_NAME = "moorage-embed-events"
#: An idle worker thread exits after this long; the next submit starts another.
IDLE_EXIT_S = 30.0
#: At interpreter exit, how long an embedding in progress may take to finish (the rest stays marked).
EXIT_WAIT_S = 10.0

_queues: "weakref.WeakSet[EmbedQueue]" = weakref.WeakSet()


class EmbedQueue:
    """Tenants with events to embed, worked through by one daemon thread (``EpisodicMemory.embed_pending``).

    What it has not done when the process dies stays marked in the store (a NULL embedding): the next start
    submits every tenant again, and a search embeds its scope's newest missing vectors itself meanwhile.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._due: dict[str, EpisodicMemory] = {}  # tenant id -> its memory, in submit order
        self._busy = 0
        self._thread: threading.Thread | None = None
        self._closed = False
        self._stopping = False  # closed without draining: the tenant in progress stops after its batch
        _queues.add(self)

    def submit(self, memory: "EpisodicMemory") -> None:
        """Embed ``memory``'s tenant's unembedded events soon (submitting it again before then is free)."""
        with self._cond:
            if self._closed:
                return
            self._due[memory.ts.tenant_id] = memory
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=THREAD_NAME, daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _work(self) -> None:
        while True:
            with self._cond:
                if not self._due and not self._closed:
                    self._cond.wait(IDLE_EXIT_S)
                if not self._due:
                    self._thread = None
                    self._cond.notify_all()
                    return
                tenant_id = next(iter(self._due))
                memory = self._due.pop(tenant_id)
                self._busy += 1
            try:
                memory.embed_pending(stop=lambda: self._stopping)
            except Exception as e:  # left marked in the store: the next submit, search or start embeds it
                log.warning("background embedding failed", tenant=tenant_id, error=str(e))
            finally:
                with self._cond:
                    self._busy -= 1
                    self._cond.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted so far has been embedded (or has failed); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._due and not self._busy, timeout)

    def close(self, timeout: float = 10.0, *, drain: bool = True) -> bool:
        """Finish what was submitted (or, without ``drain``, only the batch in progress) up to ``timeout``,
        then stop: past ``timeout`` the rest stays marked and the batch in progress is the last, waited for up to
        ``EXIT_WAIT_S`` more. Later submits are ignored. True once the worker thread has ended (the caller may then
        close the store it used)."""
        with self._cond:
            self._closed = True
            if not drain:
                self._due.clear()
                self._stopping = True
            thread = self._thread
            self._cond.notify_all()
        if thread is None:
            return True
        thread.join(timeout)
        if thread.is_alive() and drain:
            with self._cond:  # the drain ran out of time: what is left stays marked for the next start
                self._due.clear()
                self._stopping = True
            thread.join(EXIT_WAIT_S)
        if thread.is_alive():
            log.warning("background embedding still running after close", waited_s=timeout + (EXIT_WAIT_S if drain else 0))
            return False
        return True


@atexit.register
def _stop_all() -> None:
    # A daemon thread still inside the model while the interpreter tears down aborts the process
    # ("terminate called without an active exception"): let the embedding in progress end first.
    for queue in list(_queues):
        queue.close(EXIT_WAIT_S, drain=False)
