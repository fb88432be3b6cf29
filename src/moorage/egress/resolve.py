"""Name resolution for egress decisions: the system resolver, and a fixed table for tests and pinning.

The gateway resolves every name itself and connects to the addresses it judged, never to a name.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Mapping, Protocol, Sequence

from moorage.egress.addresses import IPAddress, parse_ip


class NameNotFound(Exception):
    """The name has no address (or resolution failed); the caller refuses the request."""


class Resolver(Protocol):
    async def resolve(self, host: str) -> list[IPAddress]: ...


class SystemResolver:
    """The host's own resolver (``getaddrinfo``), with a timeout."""

    def __init__(self, timeout_s: float = 5.0) -> None:
        self.timeout_s = timeout_s

    async def resolve(self, host: str) -> list[IPAddress]:
        loop = asyncio.get_running_loop()
        try:
            infos = await asyncio.wait_for(
                loop.getaddrinfo(host, None, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP), self.timeout_s)
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

    async def resolve(self, host: str) -> list[IPAddress]:
        found = self.table.get(host.lower().rstrip("."))
        if found:
            return [a for a in found if a is not None]
        if self.fallback is not None:
            return await self.fallback.resolve(host)
        raise NameNotFound(host)
