"""``ctx.fetch`` on the host: one HTTP request through the egress policy and connector, streamed with caps.

Every hop (the first request and each redirect) is decided before it is connected; bodies are read up to
a cap within one total deadline; failures reach the guest as generic errors, never raw socket errors.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from dataclasses import dataclass, field
from typing import Any, Iterable
from urllib.parse import urljoin

import httpcore

from moorage.aio import within
from moorage.egress.connector import EgressFailed, InstanceEgress
from moorage.egress.decision import Decision
from moorage.egress.limits import EgressLimited
from moorage.egress.rules import EgressDenied, Target

MAX_BODY_BYTES = 1 << 20
MAX_REDIRECTS = 5
METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")
REDIRECTS = (301, 302, 303, 307, 308)
#: Headers a guest may not set: the host owns framing, routing and the connection.
_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "proxy-authorization",
        "proxy-connection", "proxy-authenticate", "te", "trailer", "upgrade"}
#: Credentials a guest set itself are not carried to another origin by a redirect.
_ORIGIN_BOUND = {"authorization", "cookie"}


@dataclass
class FetchResult:
    status: int
    headers: list[tuple[str, str]]
    body: bytes
    url: str
    truncated: bool = False
    redirects: list[str] = field(default_factory=list)


class _Stream(httpcore.AsyncNetworkStream):
    """httpcore's view of a connection the egress connector opened (TLS is started on it by httpcore)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, usage: Any) -> None:
        self._r, self._w, self._usage = reader, writer, usage

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        data = await within(self._r.read(max_bytes), timeout)
        await self._usage.spend(len(data))
        return data

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        await self._usage.spend(len(buffer))
        self._w.write(buffer)
        await within(self._w.drain(), timeout)

    async def aclose(self) -> None:
        self._w.close()
        try:
            await within(self._w.wait_closed(), 5)
        except Exception:  # noqa: BLE001 - closing a broken connection is best-effort
            pass

    async def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                        timeout: float | None = None) -> "_Stream":
        # Certificates are checked against the name the policy admitted, on the address it judged.
        await within(self._w.start_tls(ssl_context, server_hostname=server_hostname), timeout)
        return self

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable":
            return self._r.at_eof()
        return self._w.get_extra_info(info)


class _Pinned(httpcore.AsyncNetworkBackend):
    """A network backend that can only reach the addresses of one allowing decision."""

    def __init__(self, inst: InstanceEgress, d: Decision) -> None:
        self._inst, self._d = inst, d
        self.address: str | None = None

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                          socket_options: Iterable[Any] | None = None) -> httpcore.AsyncNetworkStream:
        if host.strip("[]") != self._d.host or port != self._d.port:  # not what the decision covered
            raise EgressDenied(f"egress to {host}:{port} was not decided")
        r, w, self.address = await self._inst.egress.open(self._d)
        return _Stream(r, w, self._inst.usage)

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[Any] | None = None) -> httpcore.AsyncNetworkStream:
        raise EgressDenied("unix sockets are not reachable through egress")

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def _guest_headers(raw: Any) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in (raw or {}).items():
        name, value = str(k).strip(), str(v)
        if not name or name.lower() in _HOP or "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            continue
        out[name] = value
    return out


def _merge(headers: dict[str, str], added: dict[str, str]) -> dict[str, str]:
    """Host-added headers (bound secrets) replace any guest header of the same name."""
    lowered = {k.lower() for k in added}
    return {**{k: v for k, v in headers.items() if k.lower() not in lowered}, **added}


_TLS: ssl.SSLContext | None = None


def _tls() -> ssl.SSLContext:
    global _TLS
    if _TLS is None:
        _TLS = ssl.create_default_context()
    return _TLS


async def fetch(inst: InstanceEgress, method: str, url: str, *, headers: Any = None, body: bytes | None = None,
                timeout_s: float = 30.0, max_body: int = MAX_BODY_BYTES, max_redirects: int = MAX_REDIRECTS,
                tls: ssl.SSLContext | None = None) -> FetchResult:
    """Make one request (following allowed redirects) under ``inst``'s policy, within ``timeout_s`` in total."""
    method = str(method or "GET").upper()
    if method not in METHODS:
        raise EgressDenied(f"unsupported HTTP method {method!r}", hint=f"use one of {', '.join(METHODS)}")
    guest = _guest_headers(headers)
    if not any(k.lower() == "accept-encoding" for k in guest):
        guest["Accept-Encoding"] = "identity"  # bodies are handed back as they are, never decompressed here
    try:
        async with asyncio.timeout(timeout_s):
            return await _follow(inst, method, url, guest, body, max_body, max_redirects, tls or _tls())
    except TimeoutError:
        raise EgressFailed(f"the request did not finish within {timeout_s:g}s",
                           hint="pass a longer timeout, or fetch less") from None


async def _follow(inst: InstanceEgress, method: str, url: str, guest: dict[str, str], body: bytes | None,
                  max_body: int, max_redirects: int, tls: ssl.SSLContext) -> FetchResult:
    redirects: list[str] = []
    origin: str | None = None
    while True:
        t = Target.parse(url)
        if origin is not None and t.origin != origin:
            guest = {k: v for k, v in guest.items() if k.lower() not in _ORIGIN_BOUND}
        origin = t.origin
        d = await inst.egress.check(inst.policy, t, inst.owner)
        if not d.allowed and redirects:
            inst.span(time.time(), "denied", **{"egress.via": "fetch", "egress.scheme": d.scheme,
                                                "egress.host": d.host, "egress.port": d.port,
                                                "egress.decision": d.reason, "egress.redirect": True})
            raise EgressDenied(f"the response redirected to {t.origin}, which is not allowed for this agent",
                               hint="list it under [agent.egress] allow, or fetch with redirects you follow yourself")
        async with inst.attempt("fetch", d, **{"http.method": method,
                                               "egress.path": t.path.split("?", 1)[0][:200]}) as info:
            # Bound secrets are read only once the request is allowed, and only for a bound host.
            added = await inst.headers(t) if inst.headers is not None else {}
            info["egress.secrets"] = len(added)
            send = _merge(guest, added)
            send["Host"] = t.authority
            if body is not None:
                send["Content-Length"] = str(len(body))
            backend = _Pinned(inst, d)
            pool = httpcore.AsyncConnectionPool(ssl_context=tls, network_backend=backend, max_connections=1, retries=0)
            try:
                async with pool:
                    async with pool.stream(method, t.url, headers=list(send.items()), content=body) as resp:
                        info["http.status_code"] = resp.status
                        info["egress.address"] = backend.address
                        location = next((v.decode("latin-1") for k, v in resp.headers if k.lower() == b"location"), None)
                        if resp.status in REDIRECTS and location and len(redirects) < max_redirects:
                            redirects.append(t.url)
                            url = urljoin(t.url, location)
                            if resp.status == 303 or (resp.status in (301, 302) and method == "POST"):
                                method, body = "GET", None
                            continue
                        data, truncated = await _read_capped(resp, max_body)
                        info["egress.body_bytes"] = len(data)
                        info["egress.truncated"] = truncated
                        return FetchResult(resp.status, [(k.decode("latin-1"), v.decode("latin-1")) for k, v in resp.headers],
                                           data, t.url, truncated, redirects)
            except (EgressDenied, EgressLimited, EgressFailed):
                raise
            except (httpcore.TimeoutException, httpcore.NetworkError, httpcore.ProtocolError, ssl.SSLError, OSError) as e:
                info["egress.error"] = type(e).__name__
                raise EgressFailed(f"the request to {t.origin} failed", hint="the service may be down; retry later") from None


async def _read_capped(resp: Any, cap: int) -> tuple[bytes, bool]:
    """At most ``cap`` bytes of the body; an endless body is cut there and its connection dropped."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.aiter_stream():
        room = cap - size
        if len(chunk) > room:
            chunks.append(chunk[:room])
            return b"".join(chunks), True
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks), False
