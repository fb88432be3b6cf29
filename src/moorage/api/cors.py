"""Cross-origin requests from browsers: the origins the operator names (``cors_origins``) may call the API from
their pages (a product's page with its end-user token); any other origin, and every request without one, is served
exactly as before.

An agent's app (``.../users/{user}/app/...``, ``/v1/shared/...``) answers its own preflights (docs/app.md), so its
paths are left to it. No cookie opens the API, so no credentials are allowed: the token travels in
``Authorization``, which the page sets itself.
"""

from __future__ import annotations

import re
from typing import Any

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

APP_PATHS = re.compile(r"^/v1/(agents/[^/]+/users/[^/]+/app(/|$)|shared/)")
#: What a page's script may read of an answer besides the CORS-safe headers.
EXPOSED = ["x-trace-id", "retry-after", "location", "idempotent-replayed", "x-should-retry"]


class Cors:
    """ASGI middleware: Starlette's CORS answers for the named origins, outside the app routes."""

    def __init__(self, app: ASGIApp, origins: list[str]) -> None:
        self.app = app
        self.origins = {o.encode() for o in origins}
        self.cors = CORSMiddleware(app, allow_origins=origins, allow_methods=["GET", "POST", "PUT", "PATCH", "DELETE"],
                                   allow_headers=["*"], expose_headers=EXPOSED, max_age=600)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> Any:
        if scope["type"] != "http" or APP_PATHS.match(scope["path"]):
            return await self.app(scope, receive, send)
        if self._origin(scope) in self.origins:
            return await self.cors(scope, receive, send)

        async def varied(message: Any) -> None:
            # The answer depends on the Origin: a cache in between must not hand this one (no CORS headers) to a
            # named origin's page, which then could not read it (Starlette says so only on the CORS answers).
            if message["type"] == "http.response.start":
                headers = list(message.get("headers") or [])
                vary = [v for k, v in headers if k.lower() == b"vary"]
                if not any(b"origin" in v.lower() for v in vary):
                    headers = [(k, v) for k, v in headers if k.lower() != b"vary"]
                    headers.append((b"vary", b", ".join([*vary, b"Origin"])))
                    message = {**message, "headers": headers}
            await send(message)

        return await self.app(scope, receive, varied)

    @staticmethod
    def _origin(scope: Scope) -> bytes | None:
        for name, value in scope.get("headers") or ():
            if name == b"origin":
                return value
        return None
