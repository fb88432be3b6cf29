"""The egress gateway: the proxy and DNS listeners of each awake instance, and where their spans go.

``Gateway.bind`` gives one instance its own listeners (TCP or a unix socket for the proxy, UDP for DNS);
a shared listener can instead call ``serve_connection`` with the instance it identified by the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from moorage.aio import within
from moorage.egress.connector import Egress, InstanceEgress, SpanRecorder
from moorage.egress.dns import serve_stream, serve_udp
from moorage.egress.proxy import serve_connection
from moorage.log import get_logger

log = get_logger(__name__)


def store_recorder(ts: Any, trace_id: Callable[[], str], scope: Any = None, *, parent_id: str | None = None,
                   **attrs: Any) -> SpanRecorder:
    """Spans into a tenant's own store, written off the event loop; ``trace_id()`` names the current trace
    (an instance's turn, or its own gateway trace between turns; a deploy's, under its span ``parent_id``).
    Attributes never hold header values."""
    from moorage.store import Span

    def record(started: float, status: str, span_attrs: dict[str, Any]) -> None:
        span = Span(trace_id(), uuid.uuid4().hex[:16], parent_id, "egress", started, time.time(), status,
                    {**attrs, **span_attrs}, scope)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            ts.spans.record(span)
            return
        fut = loop.run_in_executor(None, ts.spans.record, span)
        fut.add_done_callback(lambda f: f.exception() and log.warning("egress span not recorded"))

    return record


@dataclass
class GatewayBinding:
    """One instance's listeners. ``proxy_url`` is what the guest's HTTP(S)_PROXY is set to (through the VM's
    network device, which maps the guest-visible gateway address onto it)."""

    key: str
    inst: InstanceEgress
    proxy_host: str
    proxy_port: int | None
    dns_port: int | None
    unix_path: Path | None = None
    dns_unix_path: Path | None = None
    _server: Any = field(default=None, repr=False)
    _dns: Any = field(default=None, repr=False)
    _dns_stream: Any = field(default=None, repr=False)

    @property
    def proxy_url(self) -> str:
        return f"http://{self.proxy_host}:{self.proxy_port}"

    async def close(self) -> None:
        if self._dns is not None:
            self._dns.close()
        if self._dns_stream is not None:
            self._dns_stream.close()
            with contextlib.suppress(Exception):
                await within(self._dns_stream.wait_closed(), 5)
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await within(self._server.wait_closed(), 5)
        for path in (self.unix_path, self.dns_unix_path):
            if path is not None:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()


class Gateway:
    """All gateway listeners of this host, keyed by instance (e.g. the sandbox id)."""

    def __init__(self, egress: Egress, host: str = "127.0.0.1") -> None:
        self.egress = egress
        self.host = host
        self._bound: dict[str, GatewayBinding] = {}

    def get(self, key: str) -> GatewayBinding | None:
        return self._bound.get(key)

    async def bind(self, key: str, inst: InstanceEgress, *, unix_path: Path | None = None, dns: bool = True,
                   port: int = 0, dns_port: int = 0, dns_unix_path: Path | None = None) -> GatewayBinding:
        """Open ``key``'s listeners (replacing any it had). The proxy listens on ``unix_path`` if given (for a
        per-VM socket that QEMU's guestfwd connects to), else on ``host:port``; DNS on UDP ``host:dns_port``
        and, if ``dns_unix_path`` is given, as DNS-over-TCP framing on that unix socket (guestfwd is TCP only)."""
        await self.unbind(key)

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await serve_connection(inst, reader, writer)

        if unix_path is not None:
            unix_path.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                unix_path.unlink()
            server = await asyncio.start_unix_server(handle, path=str(unix_path))
            proxy_port = None
        else:
            server = await asyncio.start_server(handle, self.host, port)
            proxy_port = server.sockets[0].getsockname()[1]
        transport, bound_dns = (await serve_udp(inst, self.host, dns_port)) if dns else (None, None)
        dns_stream = None
        if dns_unix_path is not None:
            dns_unix_path.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                dns_unix_path.unlink()

            async def handle_dns(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                await serve_stream(inst, reader, writer)

            dns_stream = await asyncio.start_unix_server(handle_dns, path=str(dns_unix_path))
        b = GatewayBinding(key, inst, self.host, proxy_port, bound_dns, unix_path, dns_unix_path, server, transport,
                           dns_stream)
        self._bound[key] = b
        return b

    async def unbind(self, key: str) -> None:
        b = self._bound.pop(key, None)
        if b is not None:
            await b.close()

    async def close(self) -> None:
        for key in list(self._bound):
            await self.unbind(key)
