"""``AsyncClient``: the asyncio client; the same methods as ``Client``, each awaited."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import httpx

from moorage.client import _transport as tr
from moorage.client import types as T
from moorage.client._api import TERMINAL, Api, Request, _deploy, _idem, _p, _turn_body
from moorage.client.errors import ApiError


class AsyncClient(Api):
    """``AsyncClient(base_url, api_key)``, found as ``Client`` finds them; use ``async with`` or
    ``await client.aclose()``."""

    def __init__(self, base_url: str | None = None, api_key: str | None = None, *, timeout_s: float | None = None,
                 max_retries: int | None = None, backoff_s: float | None = None, max_wait_s: float | None = None,
                 max_connections: int | None = None, transport: httpx.AsyncBaseTransport | None = None,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.settings = tr.Settings.resolve(base_url, api_key, timeout_s=timeout_s, max_retries=max_retries,
                                            backoff_s=backoff_s, max_wait_s=max_wait_s,
                                            max_connections=max_connections)
        self._transport = transport
        self._pid = os.getpid()
        self._pooled = self._new_http()
        self._sleep = sleep
        self.attempts: list[tuple[str, str, int]] = []

    def _new_http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.settings.base_url, headers=self.settings.headers(),
                                 timeout=self.settings.timeout_s, transport=self._transport,
                                 limits=self.settings.limits())

    @property
    def _http(self) -> httpx.AsyncClient:
        """This process's connection pool: a forked process gets its own (see ``Client._http``)."""
        if self._pid != os.getpid():
            self._pooled, self._pid = self._new_http(), os.getpid()
        return self._pooled

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _send(self, req: Request) -> Any:  # type: ignore[override]
        req = tr.prepare(req)
        attempt = 0
        while True:
            try:
                response = await self._http.request(req.method, req.path, **tr.kwargs(req))
                self._note(req, response.status_code)
                return tr.check_shown_once(req, tr.decode(response))
            except httpx.TransportError as e:
                self._note(req, 0)
                error: ApiError = tr.unreachable(self.settings, e)
            except ApiError as e:
                error = e
            wait = tr.wait_before_retry(self.settings, attempt, error, req)
            if wait is None:
                raise tr.final(req, error)
            await self._sleep(wait)
            attempt += 1

    def _note(self, req: Request, status: int) -> None:
        self.attempts.append((req.method, req.path, status))
        del self.attempts[:-1000]

    async def paginate(self, list_method: Callable[..., Any], *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        """Every item of a list method: ``async for u in c.paginate(c.list_users, "bot"): ...``."""
        cursor = kwargs.pop("cursor", None)
        while True:
            page = await list_method(*args, **kwargs, **({"cursor": cursor} if cursor else {}))
            for item in page["data"]:
                yield item
            cursor = page.get("next_cursor")
            if not cursor:
                return

    async def stream(self, agent: str, message: str, *, user: str | None = None, session: str | None = None,
                     idempotency_key: str | None = None) -> AsyncIterator[T.StreamEvent]:
        """A turn's events as they happen, then ``done`` with the result."""
        req = tr.prepare(Request("POST", f"/v1/agents/{_p(agent)}/invoke", {"stream": "true"},
                                 json=_turn_body(message, user, session),
                                 headers={"accept": "text/event-stream",
                                          **({"Idempotency-Key": idempotency_key} if idempotency_key else {})}))
        async for event in self._events(req):
            yield event

    async def deploy_stream(self, agent: str, source: bytes | str | Path, *,
                            idempotency_key: str | None = None) -> AsyncIterator[T.StreamEvent]:
        """A deploy's build as it goes: ``progress`` events ({message}), then ``deployment`` with the deployment
        (a failed build raises its ``ApiError``). Leaving early leaves the build running on the server. Asked again
        with the same ``idempotency_key`` (one is made if none is given), a deploy builds nothing: its answer is the
        one ``deployment`` event once the first build ended."""
        req = tr.prepare(_deploy(agent, source, {"content-type": "application/gzip", "accept": "text/event-stream",
                                                 **_idem(idempotency_key)}, {"stream": "true"}))
        async for event in self._events(req, answer_as="deployment"):
            yield event

    async def delete_agent_stream(self, agent: str) -> AsyncIterator[T.StreamEvent]:
        """An agent's deletion as it goes: ``progress`` events ({message}: the end-users forgotten so far), then
        ``deleted`` with what ``delete_agent`` answers. Leaving early leaves the deletion running on the server."""
        req = tr.prepare(Request("DELETE", f"/v1/agents/{_p(agent)}", {"stream": "true"},
                                 headers={"accept": "text/event-stream"}))
        async for event in self._events(req, answer_as="deleted"):
            yield event

    async def _events(self, req: Request, *, answer_as: str | None = None) -> AsyncIterator[T.StreamEvent]:
        """Server-sent events of ``req``, retried until the stream begins as ``Client._events`` does (``answer_as``
        as there)."""
        attempt = 0
        while True:
            started = False
            try:
                async with self._http.stream(req.method, req.path, **tr.kwargs(req)) as response:
                    self._note(req, response.status_code)
                    if response.status_code < 400:
                        started = True
                        if answer_as is not None and not tr.is_event_stream(response):
                            await response.aread()
                            yield {"event": answer_as, "data": tr.decode(response)}
                            return
                        buffer: list[str] = []
                        async for line in response.aiter_lines():
                            buffer.append(line)
                            if line == "":
                                for event, data in tr.sse_events(iter(buffer)):
                                    tr.raise_error_event(event, data)
                                    yield {"event": event, "data": data}
                                buffer = []
                        for event, data in tr.sse_events(iter([*buffer, ""])):
                            tr.raise_error_event(event, data)
                            yield {"event": event, "data": data}
                        return
                    await response.aread()
                    tr.decode(response)  # raises the typed error
            except httpx.TransportError as e:
                if started:
                    raise tr.cut_off(self.settings, e) from e
                self._note(req, 0)
                error: ApiError = tr.unreachable(self.settings, e)
            except ApiError as e:
                error = e
            wait = tr.wait_before_retry(self.settings, attempt, error)
            if wait is None:
                raise error
            await self._sleep(wait)
            attempt += 1

    async def wait_execution(self, execution_id: str, *, timeout_s: float = 600.0, poll_s: float = 0.5,
                             until: tuple[str, ...] = (*TERMINAL, "waiting")) -> T.Execution:
        deadline = time.monotonic() + timeout_s
        while True:
            ex = await self.get_execution(execution_id)
            if ex["status"] in until:
                return ex
            if time.monotonic() > deadline:
                raise TimeoutError(f"execution {execution_id} is still {ex['status']} after {timeout_s:g} s")
            await self._sleep(poll_s)

    async def wait(self, execution_id: str, *, timeout_s: float = 600.0, poll_s: float = 0.5) -> T.Execution:
        """Wait until an execution (turn or exec) has ended, or a turn waits for a human answer."""
        return await self.wait_execution(execution_id, timeout_s=timeout_s, poll_s=poll_s)

    async def follow_exec(self, execution_id: str) -> AsyncIterator[T.StreamEvent]:
        """A detached exec's output as it arrives (``output`` events), then one ``end`` with the execution."""
        async for event in self._events(tr.prepare(Request("GET", f"/v1/executions/{_p(execution_id)}/output",
                                                           headers={"accept": "text/event-stream"}))):
            yield event
