"""Declared endpoints: one ``Endpoint`` per route carries its auth, scope, body rules and OpenAPI facts.

``Endpoint.asgi`` wraps the handler with what every route shares: authentication, scope checks,
end-user token limits, bounded body reading, ``Idempotency-Key`` replay, a span and problem+json errors.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import inspect
import json
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Literal

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from moorage.api.credential_watch import CredentialEnded, Watch, Watched
from moorage.api.jsonbody import loads_bounded
from moorage.api.problem import PayloadTooLarge, UnsupportedMediaType, from_error, internal, with_openai_error
from moorage.fleet.forward import OwnerLapsed, forwarded, forwarded_by
from moorage.lifecycle.manager import Misplaced
from moorage.errors import (ConflictError, DiskFull, InvalidInput, MoorageError, TenantScopeError, UnavailableError,
                            disk_full)
from moorage.log import get_logger
from moorage.observability.tracer import current_trace_id, use_trace_id
from moorage.store import Principal, TenantStore
from moorage.store.model import API_KEY_SCOPES
from moorage.store.repos.journal import replay_mark

if TYPE_CHECKING:
    from moorage.api.app import AppContext

log = get_logger(__name__)

JSON_BODY_LIMIT = 1 << 20
MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_IDEM_KEY = re.compile(r"^[\x21-\x7e]{1,200}$")

Auth = Literal["tenant", "operator", "none"]
Idempotency = Literal["http", "runtime", "none"]


@dataclass(frozen=True)
class Param:
    """A query parameter as documented in the OpenAPI spec."""

    name: str
    schema: dict[str, Any]
    description: str = ""
    required: bool = False


@dataclass
class Reply:
    """A JSON reply with a status other than the endpoint's default, or extra headers."""

    body: Any
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Call:
    """Everything a handler may use: the verified principal, its tenant store and the parsed request."""

    request: Request
    ctx: "AppContext"
    principal: Principal | None
    ts: TenantStore | None
    body: Any
    trace_id: str
    idempotency_key: str | None
    #: (agent, end-user) the request turned out to be about, set by a handler that found it (a sandbox's or an
    #: execution's): its stored Idempotency-Key answer is then removed when that user is forgotten, as those of
    #: requests naming the user in their path are.
    about: tuple[str, str] | None = None

    @property
    def path(self) -> dict[str, str]:
        return self.request.path_params

    def query(self, name: str, default: str | None = None) -> str | None:
        return self.request.query_params.get(name, default)

    @property
    def tenant(self) -> TenantStore:
        assert self.ts is not None, "tenant routes always have a tenant store"
        return self.ts

    @property
    def who(self) -> Principal:
        assert self.principal is not None
        return self.principal

    @property
    def runtime(self) -> Any:
        if self.ctx.runtime is None:
            raise UnavailableError("this server runs without an agent runtime",
                                   hint="start it with `moorage up` (store-only servers serve data routes only)")
        return self.ctx.runtime

    def field(self, name: str, kinds: type | tuple[type, ...], *, required: bool = True, default: Any = None) -> Any:
        """A validated field of the JSON object body."""
        body = self.body if isinstance(self.body, dict) else {}
        if name not in body or body[name] is None:
            if required:
                raise InvalidInput(f"missing field {name!r}", hint="see the request schema in /openapi.json")
            return default
        value = body[name]
        if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
            raise InvalidInput(f"field {name!r} has the wrong type")
        if not isinstance(value, kinds):
            raise InvalidInput(f"field {name!r} has the wrong type", hint="see the request schema in /openapi.json")
        return value


Handler = Callable[[Call], Any] | Callable[[Call], Awaitable[Any]]


@dataclass(frozen=True)
class Endpoint:
    method: str
    path: str
    handler: Handler
    summary: str
    tag: str
    operation_id: str
    auth: Auth = "tenant"
    #: Scope a tenant key needs; every tenant route declares one (``admin`` keys hold every scope). This
    #: declaration is the one source of truth: the wrapper enforces it and tests/api/test_scopes.py walks it.
    scope: str | None = None
    #: Further scopes that are also enough (e.g. an execution is readable with ``invoke`` or ``read``).
    also_scopes: tuple[str, ...] = ()
    #: End-user tokens may call this route, for their own agent and user only (instead of a scope).
    end_user: bool = False
    #: The handler itself keeps a key limited to one agent to that agent (routes without ``{agent}``);
    #: other routes without ``{agent}`` in the path refuse such keys.
    agent_checked: bool = False
    body: dict[str, Any] | None = None
    body_type: str = "application/json"
    #: A body the handler reads itself (no ``body``: the wrapper leaves the stream alone), documented in OpenAPI.
    body_doc: dict[str, Any] | None = None
    response: dict[str, Any] | None = None
    status: int = 200
    query: tuple[Param, ...] = ()
    max_body: int = JSON_BODY_LIMIT
    #: The route may answer ``text/event-stream`` instead of JSON.
    streams: bool = False
    idempotency: Idempotency = "http"
    #: Other success statuses the route may answer, with their JSON schema (documented in OpenAPI; None: no body).
    other_responses: tuple[tuple[int, dict[str, Any] | None], ...] = ()
    #: The answer is relayed as an agent's app gave it: any status, any content type (documented as such).
    relayed: bool = False
    #: Response fields holding a secret shown once: a replay returns them as null (the journal never keeps them).
    secret_fields: tuple[str, ...] = ()
    #: The answer may take long (a turn, an exec, an app's request; a stream always does): the credential is checked
    #: again while it lasts, and the request ends with it (``api/credential_watch.py``).
    long_lived: bool = False

    def __post_init__(self) -> None:
        if self.auth == "tenant":
            bad = [sc for sc in (self.scope, *self.also_scopes) if sc not in API_KEY_SCOPES]
            if bad:
                raise ValueError(f"{self.method} {self.path} must declare a key scope from {API_KEY_SCOPES}, not {bad}")

    @property
    def scopes(self) -> frozenset[str]:
        """Every key scope that may call this route (``admin`` included)."""
        if self.auth != "tenant":
            return frozenset()
        return frozenset({self.scope or "admin", *self.also_scopes, "admin"})

    async def asgi(self, request: Request) -> Response:
        ctx: AppContext = request.app.state.moorage
        request.scope.setdefault("state", {})["route"] = self.path
        trace_id = current_trace_id() or request.scope["state"].get("trace_id", "")
        principal: Principal | None = None
        ts: TenantStore | None = None
        started = time.time()
        if forwarded_by(request.scope):  # signed by another host of the fleet; a caller's own marker is ignored
            forwarded.set(True)  # this request task only: another host sent it here to be served here
        held: tuple[str, str, str] | None = None
        watch: Watch | None = None
        relayed = False
        try:
            principal, ts = await self._authorize(ctx, request)
            held = _hold_end_user(ctx, principal)
            watch = self._watch(ctx, request, principal, trace_id)
            for attempt in range(_SERVINGS):
                try:
                    work = self._run(ctx, request, principal, ts, trace_id)
                    response = await (watch.race(work) if watch is not None else work)
                    relayed = False
                    break
                except Misplaced as e:
                    # The owner checks the credential of what it serves (it is forwarded with the request) and ends
                    # its stream with the final event; cutting the relay here could split one of its frames.
                    relayed = True
                    try:
                        response = await self._forward(ctx, request, e, trace_id)
                        break
                    except OwnerLapsed:
                        # Its owner froze or was cut off with it: the request is served here, as it would be once
                        # retried (the instance is this host's to claim now; what that host did is fenced off),
                        # when its body is at hand (read by the route; an app's streams on and is not).
                        if attempt + 1 == _SERVINGS or not _replayable(request):
                            raise
                        log.warning("serving here a request whose owner's lease lapsed", route=self.path,
                                    owner=e.host, trace_id=trace_id)
        except MoorageError as e:
            ctx.metrics.observe_error(e.code)
            response = from_error(e, trace_id)
        except Exception as e:  # noqa: BLE001 - the last line of defence: log it, never show a traceback
            full = disk_full(e)
            if full is not None:  # the operator's to fix, and the caller's to know: a 507 that says so
                log.error("the disk is full: a request failed", route=self.path, trace_id=trace_id,
                          error=f"{type(e).__name__}: {e}")
                ctx.metrics.observe_error(full.code)
                response = from_error(full, trace_id)
            else:
                log.exception("unhandled error", route=self.path, trace_id=trace_id)
                ctx.metrics.observe_error("internal")
                response = internal(trace_id)
        except BaseException:  # cancelled (the server stopping): the end-user's place is theirs again
            _let_go(ctx, held)
            if watch is not None:
                watch.stop()
            raise
        if self.tag == "openai" and response.status_code >= 400:
            response = with_openai_error(response)  # the official openai clients read their error from it
        if watch is not None:
            if relayed or not isinstance(response, StreamingResponse):
                watch.stop()
            else:
                response = Watched(response, watch, trace_id, openai=self.tag == "openai")
        try:
            if ts is not None:
                await run_in_threadpool(self._record_span, ctx, ts, principal, request, response.status_code, started,
                                        trace_id)
        except BaseException:
            _let_go(ctx, held)
            if isinstance(response, Watched):
                response.watch.stop()
            raise
        # The end-user's place is held until the answer is sent in full (a stream: to its end, or the caller left).
        return response if held is None else _Releasing(response, lambda: _let_go(ctx, held))

    def _watch(self, ctx: "AppContext", request: Request, principal: Principal | None, trace_id: str) -> Watch | None:
        """A check of the request's credential for as long as it lasts (long-lived routes of tenant credentials)."""
        if principal is None or not (self.long_lived or self.streams) or ctx.credential_checks is None:
            return None
        header = request.headers.get("authorization")

        async def ended(e: CredentialEnded) -> None:
            log.info("a request ended with its credential", route=self.path, trace_id=trace_id,
                     expired=e.expired, why=e.cause.message)
            end = getattr(ctx.runtime, "end_request_turns", None)
            if not e.expired and end is not None:  # revoked: its turns stop spending the tenant's budget
                await end(principal.tenant_id, trace_id, "the credential of its request was revoked")

        return Watch(lambda: ctx.credential_checks.check(header), ended)

    @staticmethod
    async def _forward(ctx: "AppContext", request: Request, e: "Misplaced", trace_id: str) -> Response:
        """The instance is awake on another host of the fleet: that host answers (docs/fleet.md)."""
        fleet = getattr(getattr(ctx.runtime, "instances", None), "fleet", None)
        if fleet is None or e.host is None:
            raise e
        owner = await run_in_threadpool(fleet.host, e.host)
        if owner is None:
            raise e
        # A body the route read is sent as read; one it relays itself (an app's) is still unread: it streams on.
        body = request.scope["state"].get("raw_body")
        return await fleet.forwarder.forward(request, body, owner.id, owner.url, trace_id)

    async def _authorize(self, ctx: "AppContext", request: Request) -> tuple[Principal | None, TenantStore | None]:
        header = request.headers.get("authorization")
        if self.auth == "none":
            return None, None
        if self.auth == "operator":
            ctx.auth.require_operator(header)
            return None, None
        principal = await run_in_threadpool(ctx.auth.authenticate, header)
        if principal.user is not None:
            if not self.end_user:
                raise TenantScopeError("end-user tokens cannot call this route",
                                       hint="use a tenant API key; end-user tokens may invoke their agent and read their own memory")
            pa, pu = request.path_params.get("agent"), request.path_params.get("user")
            if (pa is not None and pa != principal.agent) or (pu is not None and pu != principal.user):
                raise TenantScopeError("this end-user token is for another agent or user",
                                       hint="use the token issued for this agent and user")
        else:
            accepted = sorted(self.scopes - {"admin"}) or ["admin"]
            if not principal.allows(*accepted):
                raise TenantScopeError(f"this key lacks the {' or '.join(repr(a) for a in accepted)} scope",
                                       hint=f"use a key with the {accepted[0]} scope (or ask an admin for one)")
            if principal.agent is not None:
                pa = request.path_params.get("agent")
                if pa is None and not self.agent_checked:
                    raise TenantScopeError(f"this key is limited to agent {principal.agent!r}; this route spans agents",
                                           hint="use a key that is not limited to one agent")
                if pa is not None and pa != principal.agent:
                    raise TenantScopeError(f"this key is limited to agent {principal.agent!r}",
                                           hint=f"use a key for agent {pa!r}")
        return principal, ctx.store.tenant(principal)

    async def _read_body(self, request: Request) -> Any:
        if self.body is None and self.body_type == "application/json":
            return None
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            raise PayloadTooLarge(f"request body is {declared} bytes; this route accepts at most {self.max_body}",
                                  hint="send a smaller body")
        raw = request.scope["state"].get("raw_body")  # read already: the request is served here a second time
        if raw is None:
            chunks, size = [], 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > self.max_body:
                    raise PayloadTooLarge(f"request body exceeds {self.max_body} bytes", hint="send a smaller body")
                chunks.append(chunk)
            raw = b"".join(chunks)
            request.scope["state"]["raw_body"] = raw  # what a fleet forward sends on (the stream is consumed)
        if self.body_type != "application/json":
            return raw
        if not raw.strip():
            return {}
        ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
        if ctype not in ("application/json", "") and not ctype.endswith("+json"):
            raise UnsupportedMediaType(f"this route takes application/json, not {ctype}",
                                       hint="send Content-Type: application/json")
        body = loads_bounded(raw)  # 422 for bad JSON, 400 past the nesting limit (never a RecursionError)
        if not isinstance(body, dict):
            raise InvalidInput("request body must be a JSON object", hint="see the request schema in /openapi.json")
        return body

    async def _run(self, ctx: "AppContext", request: Request, principal: Principal | None, ts: TenantStore | None,
                   trace_id: str) -> Response:
        body = await self._read_body(request)
        idem = request.headers.get("idempotency-key")
        if idem is not None and not _IDEM_KEY.fullmatch(idem):
            raise InvalidInput("malformed Idempotency-Key", hint="use 1-200 visible ASCII characters (no spaces), e.g. a UUID")
        call = Call(request, ctx, principal, ts, body, trace_id, idem)
        if idem is None or ts is None or self.method not in MUTATING or self.idempotency != "http":
            return self._respond(await self._invoke(call))
        return await self._idempotent(call, idem, body)

    async def _invoke(self, call: Call) -> Any:
        if inspect.iscoroutinefunction(self.handler):
            return await self.handler(call)
        return await run_in_threadpool(self.handler, call)

    def _respond(self, result: Any) -> Response:
        if isinstance(result, Response):
            return result
        if isinstance(result, Reply):
            return json_response(result.body, result.status, result.headers)
        return json_response(result, self.status)

    async def _idempotent(self, call: Call, idem: str, body: Any) -> Response:
        """Run once per key; a replay gets the stored first response (a retry of a 5xx or 429 runs again)."""
        ts, p = call.tenant, call.who
        ident = f"{p.key_id}|{p.user}|{self.method}|{call.request.url.path}|{idem}"
        key = "http:" + hashlib.sha256(ident.encode()).hexdigest()
        raw = body if isinstance(body, bytes) else json.dumps(body, sort_keys=True).encode()
        request_sha = hashlib.sha256(raw).hexdigest()
        instances = getattr(call.ctx.runtime, "instances", None)
        mark = instances.claim_mark() if instances is not None else None
        entry, created = await run_in_threadpool(ts.journal.claim, key, claimer=mark, step=self._about(call))
        if not created and entry.status == "pending" and mark is not None and \
                await run_in_threadpool(instances.claim_abandoned, entry.result):
            # Its holder died with the request (a host crash or restart): the retry runs it instead of a 409 forever.
            taken = await run_in_threadpool(ts.journal.take_over, key, expected_version=entry.version, claimer=mark)
            if taken is not None:
                log.warning("took over an Idempotency-Key whose request died with its host", route=self.path,
                            held_by=entry.result, trace_id=call.trace_id)
                entry, created = taken, True
            else:
                entry = await run_in_threadpool(ts.journal.get, key) or entry
        if not created:
            if entry.status == "pending":
                raise ConflictError("a request with this Idempotency-Key is still in progress",
                                    hint="wait for it to finish, then retry to get its response")
            stored = entry.result or {}
            if stored.get("request_sha") != request_sha:
                raise InvalidInput("this Idempotency-Key was used with a different request",
                                   hint="use a new key for a new request")
            return json_response(stored.get("body"), int(stored.get("status", 200)), {"Idempotent-Replayed": "true"},
                                 media_type=stored.get("media_type") or "application/json")
        try:
            response = self._respond(await self._invoke(call))
        except MoorageError as e:
            if _retryable(e.http_status):
                await _release(ts, key, entry.version)
                raise
            response = from_error(e, call.trace_id)
        except BaseException:
            await _release(ts, key, entry.version)
            raise
        settles = getattr(response, "settles", None)
        if settles is not None and not _retryable(response.status_code):
            # A stream whose work goes on without its caller (a deploy's build): the key stays claimed (a retry
            # meanwhile: 409) until that work ends, and then keeps the answer its JSON form gives (replayed as it).
            task = asyncio.get_running_loop().create_task(self._keep_settled(call, key, entry.version, request_sha,
                                                                             settles), name="idempotency-key-settle")
            _RELEASING.add(task)
            task.add_done_callback(_RELEASING.discard)
            return response
        if _retryable(response.status_code) or not hasattr(response, "body"):
            await _release(ts, key, entry.version)
            return response
        if not await self._keep(call, key, entry.version, request_sha, response):
            # Done, but its answer has no room to be kept: a retry with the key waits (409) and, once there is room,
            # gets it replayed; it is not done twice.
            raise DiskFull("the host is out of disk space: the request was carried out, but its answer could not "
                           "be kept", hint="once the operator has freed space on the disk, retry with the same "
                                           "Idempotency-Key to get the answer")
        return response

    async def _keep(self, call: Call, key: str, version: int, request_sha: str, response: Response) -> bool:
        """Store ``response`` as the key's answer (False: not yet, the disk is full; it is, once there is room)."""
        stored_body = json.loads(response.body) if response.body else None
        if isinstance(stored_body, dict):
            stored_body = _redact(stored_body, self.secret_fields)
        return await _when_room(functools.partial(
            call.tenant.journal.complete, key, expected_version=version,
            result={"status": response.status_code, "body": stored_body, "request_sha": request_sha,
                    "media_type": response.media_type},
            step=replay_mark(*call.about) if call.about else None))

    async def _keep_settled(self, call: Call, key: str, version: int, request_sha: str,
                            settles: Callable[[], Awaitable[Any]]) -> None:
        """Once the work behind a streamed answer ends, keep its answer as a JSON one (a 5xx or 429: release the
        key, as for any request)."""
        try:
            try:
                final = self._respond(await settles())
            except MoorageError as e:
                if _retryable(e.http_status):
                    raise
                final = from_error(e, call.trace_id)
            if _retryable(final.status_code):
                raise UnavailableError("the streamed request's work did not end with an answer")
            await self._keep(call, key, version, request_sha, final)
        except BaseException as e:
            log.info("a streamed request's Idempotency-Key was released", route=self.path, error=str(e))
            try:
                await _release(call.tenant, key, version)
            except Exception as err:  # noqa: BLE001 - the claim stays: a retry is told the request is in progress
                log.warning("could not release a streamed request's Idempotency-Key", error=str(err))
            if not isinstance(e, Exception):
                raise

    @staticmethod
    def _about(call: Call) -> str | None:
        """The end-user a request is about (its path's, or the end-user token's), as its replay entry names them, so
        forgetting the user removes the stored answer too (``TenantStore.forget_user``)."""
        user = call.request.path_params.get("user") or (call.who.user if call.who else None)
        if not user:
            return None
        return replay_mark(call.request.path_params.get("agent") or (call.who.agent if call.who else None), user)

    def _record_span(self, ctx: "AppContext", ts: TenantStore, principal: Principal | None, request: Request,
                     status: int, started: float, trace_id: str) -> None:
        with use_trace_id(trace_id):
            active = ctx.tracer.start(ts, f"{self.method} {self.path}", **{
                "http.method": self.method, "http.route": self.path, "http.status_code": status,
                "moorage.agent": request.path_params.get("agent"),
                "moorage.user": request.path_params.get("user") or (principal.user if principal else None),
            })
            # The request span is the trace's root; spans made during the request already point at its id.
            active.span_id = request.scope["state"].get("span_id") or active.span_id
            active.start_ts = started
            active.parent_id = None
            if status >= 500:
                active.status = "error"
            ctx.tracer.finish(ts, active)


class TooManyRequests(MoorageError):
    """One end-user has as many requests in flight as the host allows; nothing was done. Retry shortly (429)."""

    code = "too-many-requests"
    http_status = 429

    def __init__(self, limit: int) -> None:
        super().__init__(f"this end-user already has {limit} requests in flight",
                         hint="wait for one to finish (close streams you no longer read), then retry")
        self.retry_after = 1.0


#: How many times a request is served here at most: once, then again after a forward whose owner's lease lapsed.
_SERVINGS = 3


def _replayable(request: Request) -> bool:
    """Whether the request can be served again here: its body was read whole by the route, or it has none."""
    if "raw_body" in request.scope["state"]:
        return True
    return request.headers.get("content-length", "0") == "0" and "transfer-encoding" not in request.headers


def _hold_end_user(ctx: "AppContext", principal: Principal | None) -> tuple[str, str, str] | None:
    """Count a request of an end-user token against its user's places (``TooManyRequests`` when none is left)."""
    if principal is None or principal.user is None:
        return None
    key = (principal.tenant_id, principal.agent or "", principal.user)
    held = ctx.end_user_requests.get(key, 0)
    if held >= ctx.max_end_user_requests:
        raise TooManyRequests(ctx.max_end_user_requests)
    ctx.end_user_requests[key] = held + 1
    return key


def _let_go(ctx: "AppContext", key: tuple[str, str, str] | None) -> None:
    if key is None:
        return
    left = ctx.end_user_requests.pop(key, 1) - 1
    if left > 0:
        ctx.end_user_requests[key] = left


class _Releasing:
    """An answer (any ASGI response) that calls ``release`` once it was sent, failed or was left by its caller."""

    def __init__(self, response: Response, release: Callable[[], None]) -> None:
        self.response = response
        self.release = release
        self.status_code = response.status_code

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            self.release()


#: Releases of Idempotency-Keys waiting for room on the disk, and keys of streamed answers waiting for their work
#: to end (held: asyncio keeps weak references to tasks).
_RELEASING: set["asyncio.Task[None]"] = set()


async def _release(ts: TenantStore, key: str, version: int) -> None:
    """Drop the claim of a request that failed, so a retry with its key runs it."""
    await _when_room(functools.partial(ts.journal.release, key, expected_version=version))


async def _when_room(write: Callable[[], Any]) -> bool:
    """Run the journal ``write`` (True), or when the disk is too full for it, run it once there is room (tried every
    second for a day) and return False. Left undone, an Idempotency-Key's claim stayed: every retry with the key was
    a 409 "still in progress" until the host restarted."""
    try:
        await run_in_threadpool(write)
        return True
    except Exception as e:
        if disk_full(e) is None:
            raise

    async def later() -> None:
        for _ in range(86400):
            await asyncio.sleep(1.0)
            try:
                await run_in_threadpool(write)
                return
            except Exception as e:  # noqa: BLE001 - still full: again; anything else: the claim stays (logged)
                if disk_full(e) is None:
                    log.warning("an Idempotency-Key's claim could not be settled after a full disk", error=str(e))
                    return

    task = asyncio.get_running_loop().create_task(later(), name="idempotency-key-when-room")
    _RELEASING.add(task)
    task.add_done_callback(_RELEASING.discard)
    return False


def _retryable(status: int) -> bool:
    """A 5xx or a 429 is not the request's answer: a retry with the same Idempotency-Key runs it again."""
    return status >= 500 or status == 429


def _redact(body: dict[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in body.items():
        out[k] = None if k in fields else (_redact(v, fields) if isinstance(v, dict) else v)
    return out


def _json_default(value: Any) -> Any:
    if isinstance(value, (set, frozenset, tuple)):
        return sorted(value) if isinstance(value, (set, frozenset)) else list(value)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None,
                  media_type: str = "application/json") -> Response:
    if status == 204:
        return Response(status_code=204, headers=headers)
    return Response(json.dumps(body, default=_json_default), status_code=status, media_type=media_type,
                    headers=headers)
