"""Host-to-host forwarding: a request for an instance awake on another host is sent on to that host.

The request goes as it came (method, path, query, body, the caller's own credentials and trace headers), so the
owner authenticates and authorises it again: forwarding grants nothing. One hop only: a forwarded request that
finds the instance moved again is answered 503 with ``Retry-After`` and the client retries.
"""

from __future__ import annotations

from contextvars import ContextVar

import httpx
from starlette.requests import Request
from starlette.responses import Response

from moorage.errors import UnavailableError

FORWARDED_BY = "x-moorage-forwarded-by"
#: Set while serving a request another host forwarded here: it must be served here, never sent on again.
forwarded: ContextVar[bool] = ContextVar("moorage_forwarded", default=False)
#: Headers that describe one connection, not the request (RFC 9110 section 7.6.1), plus those httpx sets itself.
_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                  "transfer-encoding", "upgrade", "host", "content-length"})
_TIMEOUT = httpx.Timeout(connect=5.0, read=660.0, write=60.0, pool=5.0)


class Forwarder:
    def __init__(self, host_id: str) -> None:
        self.host_id = host_id
        self._client: httpx.AsyncClient | None = None

    async def forward(self, request: Request, body: bytes, owner_id: str, owner_url: str) -> Response:
        if request.headers.get(FORWARDED_BY):
            raise UnavailableError(f"the instance moved again (now on host {owner_id!r}) while this request was forwarded",
                                   hint="retry the request")
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=_TIMEOUT, follow_redirects=False)
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP]
        headers.append((FORWARDED_BY, self.host_id))
        url = owner_url.rstrip("/") + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        try:
            resp = await self._client.request(request.method, url, content=body, headers=headers)
        except httpx.HTTPError as e:
            raise UnavailableError(f"host {owner_id!r}, where this agent is awake, did not answer: {type(e).__name__}",
                                   hint="retry; if that host is down its lease lapses and another host takes over") from e
        out = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP and k.lower() != "content-encoding"}
        out["x-moorage-served-by"] = owner_id
        return Response(resp.content, resp.status_code, out)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
