"""Connections out of the host on an agent's behalf: decide, then connect to exactly the judged address.

``Egress`` is the one host-wide service (operator policy + resolver); ``InstanceEgress`` is one instance's
view of it (its policy, limits, span recorder and secret headers), shared by its gateway and ``ctx.fetch``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl as ssl_mod
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

from moorage.aio import within
from moorage.egress.decision import Decision, decide_target, decide_tunnel
from moorage.egress.limits import Usage
from moorage.egress.policy import EgressPolicy, OperatorPolicy
from moorage.egress.resolve import Resolver, SystemResolver
from moorage.egress.rules import Target
from moorage.errors import UnavailableError
from moorage.log import get_logger

log = get_logger(__name__)

#: Longest a connection waits for its turn under the instance's connection rate before it is refused instead.
RATE_WAIT_S = 5.0
#: Records one connection attempt: (started wall time, status, attributes). Never given header values.
SpanRecorder = Callable[[float, str, dict[str, Any]], None]
#: Headers the host adds for a target (bound secrets); values never leave the host's process except upstream.
HeaderSource = Callable[[Target], Awaitable[dict[str, str]]]


class EgressFailed(UnavailableError):
    """The upstream could not be reached or broke off. Deliberately generic: the guest learns no more."""

    code = "egress-failed"
    http_status = 502


class Egress:
    """The host's egress service: every outside connection an agent causes is decided and opened here."""

    def __init__(self, operator: OperatorPolicy | None = None, resolver: Resolver | None = None, *,
                 connect_timeout_s: float = 10.0) -> None:
        self.operator = operator or OperatorPolicy()
        self.resolver: Resolver = resolver or SystemResolver()
        self.connect_timeout_s = connect_timeout_s
        self._usage: dict[str, Usage] = {}

    @classmethod
    def from_config(cls, cfg: Any, resolver: Resolver | None = None) -> "Egress":
        return cls(OperatorPolicy.from_config(cfg), resolver)

    def usage_for(self, key: str) -> Usage:
        """The limit counters of one instance (shared by its gateway binding and its ``ctx.fetch`` calls)."""
        usage = self._usage.get(key)
        if usage is None:
            if len(self._usage) >= 10_000:  # instances that went away without ``forget``: drop the oldest
                self._usage.pop(next(iter(self._usage)))
            usage = self._usage[key] = Usage(self.operator.limits)
        return usage

    def forget(self, key: str) -> None:
        """An instance went to sleep: its counters start afresh on the next wake."""
        self._usage.pop(key, None)

    def policy_for(self, manifest: dict[str, Any] | None) -> EgressPolicy:
        return EgressPolicy.from_manifest(manifest, self.operator)

    def instance(self, manifest: dict[str, Any] | None, *, record: SpanRecorder | None = None,
                 headers: HeaderSource | None = None, usage: Usage | None = None,
                 owner: str = "") -> "InstanceEgress":
        """One instance's egress: its agent's policy, its own limits, where its spans go, its secret headers;
        ``owner`` (its tenant) is whose share of the resolver's lookups its names use."""
        return InstanceEgress(self, self.policy_for(manifest), usage or Usage(self.operator.limits), record, headers,
                              owner=owner)

    async def check(self, policy: EgressPolicy, t: Target, owner: str = "") -> Decision:
        return await decide_target(policy, self.resolver, t, owner)

    async def check_tunnel(self, policy: EgressPolicy, host: str, port: int, owner: str = "") -> Decision:
        return await decide_tunnel(policy, self.resolver, host, port, owner)

    async def open(self, d: Decision, *, tls: ssl_mod.SSLContext | None = None,
                   server_hostname: str | None = None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, str]:
        """Connect to one of the decision's addresses (in order). Returns the streams and the address used."""
        if not d.allowed or not d.addresses:
            raise AssertionError("open() needs an allowing decision")  # a caller bug, never a guest's doing
        for ip in d.addresses:
            try:
                r, w = await within(
                    asyncio.open_connection(str(ip), d.port, ssl=tls,
                                            server_hostname=(server_hostname or d.host) if tls else None),
                    self.connect_timeout_s)
                return r, w, str(ip)
            except (OSError, asyncio.TimeoutError, ssl_mod.SSLError) as e:
                log.info("egress connect failed", host=d.host, port=d.port, error=type(e).__name__)
        raise EgressFailed(f"could not connect to {d.host}:{d.port}", hint="the service may be down; retry later")


@dataclass
class InstanceEgress:
    egress: Egress
    policy: EgressPolicy
    usage: Usage
    record: SpanRecorder | None = None
    headers: HeaderSource | None = None
    #: Extra span attributes (e.g. which listener); never secrets.
    attrs: dict[str, Any] = field(default_factory=dict)
    #: Whose share of the resolver's lookups this instance's names use (its tenant; "" for the host's own).
    owner: str = ""

    def span(self, started: float, status: str, **attrs: Any) -> None:
        if self.record is None:
            return
        try:
            self.record(started, status, {**self.attrs, **attrs})
        except Exception as e:  # tracing never breaks a connection
            log.warning("egress span not recorded", error=type(e).__name__)

    @contextlib.asynccontextmanager
    async def attempt(self, via: str, d: Decision, **attrs: Any) -> AsyncIterator[dict[str, Any]]:
        """Account one connection attempt: limits on entry, one span on exit (the yielded dict adds attributes)."""
        started = time.time()
        info: dict[str, Any] = {"egress.via": via, "egress.scheme": d.scheme, "egress.host": d.host,
                                "egress.port": d.port, "egress.decision": d.reason, **attrs}
        if not d.allowed:
            self.span(started, "denied", **info)
            d.raise_if_denied()
        try:
            wait = self.usage.reserve(RATE_WAIT_S)
        except Exception as e:
            self.span(started, "limited", **info, **{"egress.error": getattr(e, "code", type(e).__name__)})
            raise
        status = "ok"
        try:
            if wait:
                info["egress.rate_wait_ms"] = round(wait * 1e3, 1)
                await asyncio.sleep(wait)
            yield info
        except BaseException as e:
            status = "error"
            info["egress.error"] = getattr(e, "code", type(e).__name__)
            raise
        finally:
            self.usage.release()
            self.span(started, status, **info)
