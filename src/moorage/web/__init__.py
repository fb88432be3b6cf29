"""The dashboard at ``/ui``: static HTML, one vanilla JS file and CSS, shipped as package data.

The page holds no data and no secret. It asks for an API key once, keeps it in the tab's ``sessionStorage`` and
calls the JSON API with it, so every number it shows went through the API's auth and tenant scoping.

It is served by an ASGI layer in front of the router rather than as entries of ``app.routes``: the app's routes
are the API (each one authenticated, documented in the OpenAPI spec and attacked by the cross-tenant suite),
while these are public, fixed files.
"""

from __future__ import annotations

from pathlib import Path

from starlette.exceptions import HTTPException
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

STATIC_DIR = Path(__file__).resolve().parent / "static"
PREFIX = "/ui"

#: Everything the page loads comes from this server; nothing inline, no frames, no referrer to leak the URL.
SECURITY_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"content-security-policy",
     b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
     b"base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
    # The files change with the installed version; revalidating is cheap (ETag) and never shows a stale UI.
    (b"cache-control", b"no-cache"),
)


class Dashboard:
    """ASGI middleware: ``GET``/``HEAD`` under ``/ui`` are answered from ``STATIC_DIR``; all else passes through."""

    def __init__(self, app: ASGIApp, directory: Path = STATIC_DIR) -> None:
        self.app = app
        self.files = StaticFiles(directory=directory, html=True)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = _route_path(scope) if scope["type"] == "http" else ""
        if not (path == PREFIX or path.startswith(PREFIX + "/")):
            await self.app(scope, receive, send)
            return
        # Metrics label the request by this template, never by the file asked for.
        scope.setdefault("state", {})["route"] = PREFIX
        if scope.get("method") not in ("GET", "HEAD"):
            await _plain(send, 405, b"the dashboard is read-only: GET it", [(b"allow", b"GET, HEAD")])
            return
        if path == PREFIX:
            # A relative link on the page must resolve under /ui/, so the bare prefix redirects there.
            await _plain(send, 307, b"", [(b"location", PREFIX.encode() + b"/")])
            return
        # As a Starlette Mount does it: the full path stays, the prefix joins root_path.
        sub = {**scope, "root_path": scope.get("root_path", "") + PREFIX}

        async def send_secured(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = {k for k, _ in SECURITY_HEADERS}
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() not in names]
                message = {**message, "headers": [*headers, *SECURITY_HEADERS]}
            await send(message)

        try:
            await self.files(sub, receive, send_secured)
        except HTTPException as e:
            # StaticFiles signals a missing file by raising; this layer sits outside the app's exception
            # handlers, so it answers itself rather than letting the server turn it into a 500.
            await _plain(send, e.status_code, b"no such dashboard file", [])


def _route_path(scope: Scope) -> str:
    """The request path without the server's root_path (set when mounted behind a path-prefixing proxy)."""
    path: str = scope.get("path", "")
    root: str = scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


async def _plain(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                            (b"content-length", str(len(body)).encode()), *headers, *SECURITY_HEADERS]})
    await send({"type": "http.response.body", "body": body})
