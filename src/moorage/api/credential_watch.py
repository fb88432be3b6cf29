"""A long-lived answer ends with the credential that opened it: turns (JSON or streamed), exec output, an app's
request and WebSocket are checked again every ``RECHECK_S`` while they last, and cut once the credential is gone.

What happens to a turn under way then is docs/security.md's ("Credentials that end mid-request"): a credential that
was revoked (a key revoked, or the key that issued the end-user token; its tenant gone) cancels the request's turns,
so a leaked key stops spending the tenant's model budget; an end-user token that merely expired lets the turn finish
detached (its reply is kept in the session, which a fresh token reads).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from typing import Any, Awaitable, Callable

from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from moorage.api.auth import TokenExpired
from moorage.api.sse import frame
from moorage.errors import MoorageError, Unauthenticated
from moorage.log import get_logger

log = get_logger(__name__)

#: How often a credential is checked again while a request it opened lasts (tests shorten it).
RECHECK_S = 5.0


class CredentialEnded(Unauthenticated):
    """The credential that opened a request still under way was revoked or expired (401, in-band on a stream)."""

    code = "credential-ended"

    def __init__(self, cause: MoorageError, *, starts_turns: bool = True) -> None:
        self.expired = isinstance(cause, TokenExpired)
        then = ("" if not starts_turns else
                "; the turn under way finishes on its own (a fresh token reads its reply in the session)" if self.expired
                else "; turns it started were cancelled")
        super().__init__(f"the credential of this request ended while it was open: {cause.message}",
                         hint=f"{cause.hint or 'use a valid credential'}{then}")
        self.cause = cause


async def until_ended(check: Callable[[], Awaitable[Any]], *, starts_turns: bool = True) -> CredentialEnded:
    """Returns once ``check`` (run every ``RECHECK_S``) refuses the credential with a 401, 403 or 404. A store out
    of reach (any other failure) is not taken for a revocation: checked again next time. ``starts_turns``: whether
    what the credential opened may have started turns (an app's request, a share link's, starts none)."""
    while True:
        await asyncio.sleep(RECHECK_S)
        try:
            await check()
        except MoorageError as e:
            if e.http_status in (401, 403, 404):
                return CredentialEnded(e, starts_turns=starts_turns)
        except Exception:  # noqa: BLE001 - the store out of reach: checked again next time
            continue


class Checks:
    """One verification of a credential serves every request it has open for ``RECHECK_S`` / 2: a browser with
    thirty streams costs the store one check per period, not thirty."""

    def __init__(self, authenticate: Callable[[str | None], Any]) -> None:
        self._authenticate = authenticate
        self._recent: dict[str, tuple[float, BaseException | None]] = {}

    async def check(self, header: str | None) -> None:
        key = hashlib.sha256((header or "").encode()).hexdigest()
        now = time.monotonic()
        seen = self._recent.get(key)
        if seen is None or now - seen[0] >= RECHECK_S / 2:
            try:
                await run_in_threadpool(self._authenticate, header)
                seen = (now, None)
            except MoorageError as e:
                seen = (now, e)
            for k, (at, _) in list(self._recent.items()):
                if now - at >= RECHECK_S:
                    self._recent.pop(k, None)
            self._recent[key] = seen
        if seen[1] is not None:
            raise seen[1]


class Watch:
    """The check of one request's credential for as long as the request lasts (``race`` its handler, then
    ``Watched`` its answer). ``ended`` runs once when the credential is found gone, before the caller is told."""

    def __init__(self, check: Callable[[], Awaitable[Any]],
                 ended: Callable[[CredentialEnded], Awaitable[None]], *, starts_turns: bool = True) -> None:
        self._task = asyncio.get_running_loop().create_task(until_ended(check, starts_turns=starts_turns),
                                                            name="credential-watch")
        self._ended = ended
        self._handled = False

    async def _fire(self) -> CredentialEnded:
        e = self._task.result()
        if not self._handled:
            self._handled = True
            try:
                await self._ended(e)
            except Exception as err:  # noqa: BLE001 - the caller is told either way
                log.warning("could not end what a revoked credential started", error=f"{type(err).__name__}: {err}")
        return e

    async def race(self, work: Awaitable[Any]) -> Any:
        """``work``'s result; if the credential ends first, ``work`` is cancelled and ``CredentialEnded`` raised."""
        job = asyncio.ensure_future(work)
        try:
            await asyncio.wait({job, self._task}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            job.cancel()
            raise
        if job.done():
            return job.result()
        job.cancel()
        await asyncio.wait({job})
        if not job.cancelled() and job.exception() is None:
            return job.result()  # it finished as it was cancelled
        raise await self._fire()

    def stop(self) -> None:
        self._task.cancel()


def final_event(e: CredentialEnded, trace_id: str, openai: bool) -> bytes:
    """The last frame of a stream cut by ``e``: moorage's ``error`` event, or OpenAI's in-band error then ``[DONE]``."""
    payload = {"type": e.code, "status": e.http_status, "detail": e.message, "hint": e.hint, "trace_id": trace_id}
    if openai:
        err = {**payload, "message": e.message, "code": e.code}
        return f"data: {json.dumps({'error': err})}\n\ndata: [DONE]\n\n".encode()
    return frame("error", payload)


class Watched(Response):
    """An answer sent under a ``Watch``: once the credential ends, a ``text/event-stream`` is ended with
    ``final_event``, any other body still streaming is cut (the connection closed), an answer not begun is a 401.
    A ``Response`` (its status and headers are the answer's) so a handler may return it as it is."""

    def __init__(self, response: Any, watch: Watch, trace_id: str, openai: bool) -> None:
        self.response = response
        self.watch = watch
        self.trace_id = trace_id
        self.openai = openai
        self.status_code = response.status_code
        self.raw_headers = response.raw_headers
        self.background = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        started: dict[str, Any] = {}

        async def tracked(message: Any) -> None:
            if message["type"] == "http.response.start":
                started.update(message)
            await send(message)

        sending = asyncio.ensure_future(self.response(scope, receive, tracked))
        try:
            await asyncio.wait({sending, self.watch._task}, return_when=asyncio.FIRST_COMPLETED)
            if sending.done():
                return sending.result()
            sending.cancel()
            await asyncio.wait({sending})
            if sending.done() and not sending.cancelled() and sending.exception() is None:
                return None  # it was sent in full as it was cut
            e = await self.watch._fire()
            if not started:
                from moorage.api.problem import from_error

                await from_error(e, self.trace_id)(scope, receive, send)
                return None
            ctype = dict((k.lower(), v) for k, v in started.get("headers", [])).get(b"content-type", b"")
            if ctype.startswith(b"text/event-stream"):
                await send({"type": "http.response.body", "body": final_event(e, self.trace_id, self.openai),
                            "more_body": False})
                return None
            raise e  # a body of another kind cannot say why: the server closes the connection mid-body
        finally:
            if not sending.done():
                sending.cancel()
            self.watch.stop()
