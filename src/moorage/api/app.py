"""The application factory: ``create_app(runtime_or_store, config)`` wires routes, auth, errors and metrics.

Given a ``Runtime`` every route works; given only a ``Store`` the data routes work and turn routes say 503.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from moorage.api.auth import Authenticator
from moorage.api.cors import Cors
from moorage.api.credential_watch import Checks
from moorage.api.middleware import RequestContext
from moorage.api.openapi import build_spec
from moorage.api.problem import from_error, internal, problem
from moorage.api.readiness import Readiness
from moorage.api.routes import all_endpoints
from moorage.api.routes.app import WEBSOCKET_ROUTES
from moorage.config import Config, parse_origins
from moorage.log import get_logger
from moorage.observability import Metrics, SpanSink, Tracer
from moorage.store import Store
from moorage.web import Dashboard

log = get_logger(__name__)


@dataclass
class AppContext:
    """What routes share; reached as ``request.app.state.moorage``."""

    store: Store
    runtime: Any | None
    config: Config
    auth: Authenticator
    tracer: Tracer
    metrics: Metrics
    #: Requests one end-user (tenant, agent, user) may have in flight at once with end-user tokens (streams to their
    #: end included): the token lives in a browser, which needs a few; past it a 429 (``api/routing.py``).
    max_end_user_requests: int = 32
    #: Requests in flight per end-user, as ``max_end_user_requests`` counts them.
    end_user_requests: dict[tuple[str, str, str], int] = field(default_factory=dict)
    #: Checks of credentials again while requests they opened last (``api/credential_watch.Checks``).
    credential_checks: Any = None
    #: ``GET /readyz``'s checks (``api/readiness.py``).
    readiness: Any = None
    _embedder: Any = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def embedder(self) -> Any:
        """The memory embedder, loaded on first use (the runtime's own when it has one)."""
        with self._lock:
            if self._embedder is None:
                own = getattr(self.runtime, "embedder", None)
                if own is None:
                    from moorage.memory import default_embedder

                    own = default_embedder()
                self._embedder = own
        return self._embedder


def _instance_counts(store: Store):
    # One aggregate per tenant (rows never leave the database); Metrics caches the result between scrapes.
    def count() -> dict[str, int]:
        out: dict[str, int] = {}
        for ts in store.operator.tenants():
            for state, n in ts.read("SELECT state, COUNT(*) FROM sandboxes GROUP BY state"):
                out[state] = out.get(state, 0) + int(n)
        return out

    return count


def create_app(runtime_or_store: Any, config: Config, *, authenticator: Authenticator | None = None,
               span_sink: SpanSink | None = None) -> Starlette:
    """Build the HTTP app. Pass the ``Runtime`` (or, for data-only serving, the ``Store``)."""
    if isinstance(runtime_or_store, Store):
        store, runtime = runtime_or_store, None
    else:
        store, runtime = runtime_or_store.store, runtime_or_store
    from moorage.observability.host_gauges import store_backlog

    metrics = Metrics(_instance_counts(store), data_dir=config.data_dir, runtime=runtime, backlog=store_backlog(store))
    ctx = AppContext(store, runtime, config, authenticator or Authenticator.for_data_dir(store, config.data_dir),
                     Tracer(span_sink), metrics, max_end_user_requests=config.end_user_max_requests)
    ctx.credential_checks = Checks(ctx.auth.authenticate)
    ctx.readiness = Readiness(store, runtime)
    endpoints = all_endpoints()
    spec = build_spec(endpoints)

    async def openapi(request: Request) -> Response:
        request.scope.setdefault("state", {})["route"] = "/openapi.json"  # its own series, not "unmatched"
        return JSONResponse(spec)

    async def prometheus(request: Request) -> Response:
        from starlette.concurrency import run_in_threadpool

        from moorage.errors import MoorageError

        # Host-wide figures, outside every tenant: the operator token or the scrape-only metrics token.
        request.scope.setdefault("state", {})["route"] = "/metrics"  # scrapes are their own series, not "unmatched"
        try:
            ctx.auth.require_metrics(request.headers.get("authorization"))
        except MoorageError as e:
            metrics.observe_error(e.code)
            return from_error(e, request.scope.get("state", {}).get("trace_id"))
        return Response(await run_in_threadpool(metrics.render), media_type=metrics.content_type)

    routes = [Route(ep.path, ep.asgi, methods=[ep.method], name=ep.operation_id) for ep in endpoints]
    routes += [Route("/openapi.json", openapi, methods=["GET"]), Route("/metrics", prometheus, methods=["GET"])]
    routes += WEBSOCKET_ROUTES  # an agent's app over WebSocket (authorized like its GET route)

    def http_error(request: Request, exc: Exception) -> Response:
        trace_id = request.scope.get("state", {}).get("trace_id")
        if isinstance(exc, HTTPException):
            if exc.status_code == 404:
                return problem(404, "no-route", f"no route {request.method} {request.url.path}",
                               hint="see /openapi.json for the routes", trace_id=trace_id)
            if exc.status_code == 405:
                return problem(405, "method-not-allowed", f"{request.method} is not allowed on {request.url.path}",
                               hint=f"allowed: {exc.headers.get('Allow', '') if exc.headers else ''}",
                               trace_id=trace_id, headers=dict(exc.headers or {}))
            return problem(exc.status_code, "http", str(exc.detail), trace_id=trace_id)
        log.error("unhandled error", trace_id=trace_id, error=type(exc).__name__)
        return internal(trace_id)

    app = Starlette(
        routes=routes,
        # The dashboard (/ui, static files) sits inside RequestContext so its responses get trace ids and metrics.
        middleware=[Middleware(RequestContext, metrics=metrics, max_body=max(ep.max_body for ep in endpoints)),
                    *([Middleware(Cors, origins=parse_origins(config.cors_origins))] if config.cors_origins else []),
                    Middleware(Dashboard)],
        exception_handlers={HTTPException: http_error, Exception: http_error},
    )
    app.state.moorage = ctx
    return app
