"""Name resolution for egress decisions: the system resolver, and a fixed table for tests and pinning.

The gateway resolves every name itself and connects to the addresses it judged, never to a name.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Mapping, Protocol, Sequence

from moorage.aio import within
from moorage.egress.addresses import IPAddress, parse_ip


class NameNotFound(Exception):
    """The name has no address (or resolution failed); the caller refuses the request."""


class Resolver(Protocol):
    async def resolve(self, host: str, owner: str = "") -> list[IPAddress]: ...


#: Threads the system resolver looks names up on. Its own, never asyncio's default executor, where every tenant's
#: store hops run: a guest asking for names whose servers never answer holds these threads, not those.
LOOKUP_THREADS = 8
#: Lookups one owner (a tenant) may have on those threads at once, counted until the thread returns (a lookup the
#: caller gave up on still holds its thread until the C library's own timeout): one tenant's slow names cannot
#: take every thread from the others. A further lookup waits for a slot within the timeout.
LOOKUPS_PER_OWNER = 2

Lookup = Callable[[str], list[Any]]


def _getaddrinfo(host: str) -> list[Any]:
    return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)


class _Slots:
    """How many lookups each owner has running; a waiter is woken when one of its owner's ends (thread-safe: a
    lookup ends on its thread)."""

    def __init__(self, per_owner: int) -> None:
        self.per_owner = per_owner
        self.lock = threading.Lock()
        self.busy: dict[str, int] = {}
        self.waiters: dict[str, list[asyncio.Future[None]]] = {}

    async def take(self, owner: str, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            with self.lock:
                if self.busy.get(owner, 0) < self.per_owner:
                    self.busy[owner] = self.busy.get(owner, 0) + 1
                    return
                wake: asyncio.Future[None] = loop.create_future()
                self.waiters.setdefault(owner, []).append(wake)
            try:
                await within(wake, max(0.0, deadline - loop.time()))
            finally:
                with self.lock:
                    queue = self.waiters.get(owner, [])
                    if wake in queue:
                        queue.remove(wake)
                    if not queue:
                        self.waiters.pop(owner, None)

    def give(self, owner: str) -> None:
        with self.lock:
            left = self.busy.get(owner, 0) - 1
            if left > 0:
                self.busy[owner] = left
            else:
                self.busy.pop(owner, None)
            waiting = list(self.waiters.get(owner, ()))
        for wake in waiting:  # each checks again under the lock; one that gave up meanwhile loses nothing
            wake.get_loop().call_soon_threadsafe(_wake, wake)


def _wake(f: asyncio.Future[None]) -> None:
    if not f.done():
        f.set_result(None)


class SystemResolver:
    """The host's own resolver (``getaddrinfo``), with a timeout, on its own threads, a few lookups per owner."""

    def __init__(self, timeout_s: float = 5.0, *, threads: int = LOOKUP_THREADS,
                 per_owner: int = LOOKUPS_PER_OWNER, lookup: Lookup | None = None) -> None:
        self.timeout_s = timeout_s
        self._lookup = lookup or _getaddrinfo
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self.slots = _Slots(per_owner)

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="resolver")
            return self._pool

    async def resolve(self, host: str, owner: str = "") -> list[IPAddress]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            await self.slots.take(owner, self.timeout_s)
        except asyncio.TimeoutError as e:
            raise NameNotFound(host) from e
        try:
            job: Future[list[Any]] = self._executor().submit(self._lookup, host)
        except BaseException:
            self.slots.give(owner)
            raise
        job.add_done_callback(lambda _: self.slots.give(owner))  # the slot is free when the thread is
        try:
            infos = await within(asyncio.wrap_future(job),
                                           max(0.0, self.timeout_s - (loop.time() - started)))
        except (OSError, asyncio.TimeoutError, UnicodeError) as e:
            raise NameNotFound(host) from e
        out: list[IPAddress] = []
        for family, *_, sockaddr in infos:
            if family not in (socket.AF_INET, socket.AF_INET6):
                continue
            ip = parse_ip(str(sockaddr[0]).split("%", 1)[0])
            if ip is not None and ip not in out:
                out.append(ip)
        if not out:
            raise NameNotFound(host)
        return out


class StaticResolver:
    """A fixed name → addresses table (tests map names into 127.0.0.0/8 with it); other names fall through
    to ``fallback`` if one is given, else are not found."""

    def __init__(self, table: Mapping[str, Sequence[str]], fallback: Resolver | None = None) -> None:
        self.table = {k.lower().rstrip("."): [parse_ip(a) for a in v] for k, v in table.items()}
        self.fallback = fallback

    async def resolve(self, host: str, owner: str = "") -> list[IPAddress]:
        found = self.table.get(host.lower().rstrip("."))
        if found:
            return [a for a in found if a is not None]
        if self.fallback is not None:
            return await self.fallback.resolve(host, owner)
        raise NameNotFound(host)
