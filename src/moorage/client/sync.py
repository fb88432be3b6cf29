"""``Client``: the blocking client (httpx), with retries that honour ``Retry-After``, page iterators,
streaming turns and waiting on executions."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx

from moorage.client import _transport as tr
from moorage.client import types as T
from moorage.client._api import TERMINAL, Api, Request, _deploy, _idem, _p, _turn_body
from moorage.client.errors import ApiError


class Client(Api):
    """``Client(base_url, api_key)``; both default to ``MOORAGE_API_URL`` / ``MOORAGE_API_KEY``, then to the local
    server and, for a server on this machine, the admin key ``moorage up`` wrote in its data directory.

    Every method of ``Api`` (see docs/sdk.md) returns the decoded answer or raises an ``ApiError`` subclass.
    """

    def __init__(self, base_url: str | None = None, api_key: str | None = None, *, timeout_s: float | None = None,
                 max_retries: int | None = None, backoff_s: float | None = None, max_wait_s: float | None = None,
                 max_connections: int | None = None, transport: httpx.BaseTransport | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.settings = tr.Settings.resolve(base_url, api_key, timeout_s=timeout_s, max_retries=max_retries,
                                            backoff_s=backoff_s, max_wait_s=max_wait_s,
                                            max_connections=max_connections)
        self._transport = transport
        self._pid = os.getpid()
        self._pooled = self._new_http()
        self._sleep = sleep
        #: (method, path, status) of every attempt, newest last (bounded), of every thread using this client.
        self.attempts: list[tuple[str, str, int]] = []

    def _new_http(self) -> httpx.Client:
        return httpx.Client(base_url=self.settings.base_url, headers=self.settings.headers(),
                            timeout=self.settings.timeout_s, transport=self._transport,
                            limits=self.settings.limits())

    @property
    def _http(self) -> httpx.Client:
        """The connection pool (httpx's, shared safely by threads) of this process: a process forked from the one
        that made the client (a pre-fork server's worker) gets its own, since talking over the parent's kept-alive
        connections would hand each process the other's answers. The parent's are left to the parent."""
        if self._pid != os.getpid():
            self._pooled, self._pid = self._new_http(), os.getpid()
        return self._pooled

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, req: Request) -> Any:
        req = tr.prepare(req)
        attempt = 0
        while True:
            try:
                response = self._http.request(req.method, req.path, **tr.kwargs(req))
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
            self._sleep(wait)
            attempt += 1

    def _note(self, req: Request, status: int) -> None:
        self.attempts.append((req.method, req.path, status))
        del self.attempts[:-1000]

    # -- iteration, streaming, waiting ----------------------------------------------------------------------

    def paginate(self, list_method: Callable[..., Any], *args: Any, **kwargs: Any) -> Iterator[Any]:
        """Every item of a list method, page after page: ``for u in c.paginate(c.list_users, "bot"): ...``."""
        cursor = kwargs.pop("cursor", None)
        while True:
            # A list with no pages (webhooks, secrets) takes no cursor: it is passed only when there is one.
            page = list_method(*args, **kwargs, **({"cursor": cursor} if cursor else {}))
            yield from page["data"]
            cursor = page.get("next_cursor")
            if not cursor:
                return

    def stream(self, agent: str, message: str, *, user: str | None = None, session: str | None = None,
               idempotency_key: str | None = None) -> Iterator[T.StreamEvent]:
        """A turn's events as they happen (``token``, ``tool``, ``event``), then ``done`` with the result."""
        req = tr.prepare(Request("POST", f"/v1/agents/{_p(agent)}/invoke", {"stream": "true"},
                                 json=_turn_body(message, user, session),
                                 headers={"accept": "text/event-stream",
                                          **({"Idempotency-Key": idempotency_key} if idempotency_key else {})}))
        yield from self._events(req)

    def deploy_stream(self, agent: str, source: bytes | str | Path, *,
                      idempotency_key: str | None = None) -> Iterator[T.StreamEvent]:
        """A deploy's build as it goes: ``progress`` events ({message}), then ``deployment`` with the deployment
        (a failed build raises its ``ApiError``). Leaving early leaves the build running on the server. Asked again
        with the same ``idempotency_key`` (one is made if none is given), a deploy builds nothing: its answer is the
        one ``deployment`` event once the first build ended."""
        yield from self._events(tr.prepare(_deploy(agent, source, {"content-type": "application/gzip",
                                                                   "accept": "text/event-stream",
                                                                   **_idem(idempotency_key)}, {"stream": "true"})),
                                answer_as="deployment")

    def delete_agent_stream(self, agent: str) -> Iterator[T.StreamEvent]:
        """An agent's deletion as it goes: ``progress`` events ({message}: the end-users forgotten so far), then
        ``deleted`` with what ``delete_agent`` answers. Leaving early leaves the deletion running on the server."""
        yield from self._events(tr.prepare(Request("DELETE", f"/v1/agents/{_p(agent)}", {"stream": "true"},
                                                   headers={"accept": "text/event-stream"})), answer_as="deleted")

    def _events(self, req: Request, *, answer_as: str | None = None) -> Iterator[T.StreamEvent]:
        """Server-sent events of ``req``. Until the stream begins, a refusal or a failed connection is retried as any
        request is (and raised as its ``ApiError``); a connection lost once events came is ``Unavailable``.
        ``answer_as``: a JSON answer instead of a stream (a server from before the route streamed) is that one
        event."""
        attempt = 0
        while True:
            started = False
            try:
                with self._http.stream(req.method, req.path, **tr.kwargs(req)) as response:
                    self._note(req, response.status_code)
                    if response.status_code < 400:
                        started = True
                        if answer_as is not None and not tr.is_event_stream(response):
                            response.read()
                            yield {"event": answer_as, "data": tr.decode(response)}
                            return
                        for event, data in tr.sse_events(response.iter_lines()):
                            tr.raise_error_event(event, data)
                            yield {"event": event, "data": data}
                        return
                    response.read()
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
            self._sleep(wait)
            attempt += 1

    def wait_execution(self, execution_id: str, *, timeout_s: float = 600.0, poll_s: float = 0.5,
                       until: tuple[str, ...] = (*TERMINAL, "waiting")) -> T.Execution:
        """Poll an execution until its status is one of ``until`` (default: finished or waiting for a human)."""
        deadline = time.monotonic() + timeout_s
        while True:
            ex = self.get_execution(execution_id)
            if ex["status"] in until:
                return ex
            if time.monotonic() > deadline:
                raise TimeoutError(f"execution {execution_id} is still {ex['status']} after {timeout_s:g} s")
            self._sleep(poll_s)

    def wait(self, execution_id: str, *, timeout_s: float = 600.0, poll_s: float = 0.5) -> T.Execution:
        """Wait until an execution (turn or exec) has ended, or a turn waits for a human answer."""
        return self.wait_execution(execution_id, timeout_s=timeout_s, poll_s=poll_s)

    def follow_exec(self, execution_id: str) -> Iterator[T.StreamEvent]:
        """A detached exec's output as it arrives: ``output`` events ({stream, offset, text}) from the oldest byte
        kept, then one ``end`` with the execution (without its output)."""
        yield from self._events(tr.prepare(Request("GET", f"/v1/executions/{_p(execution_id)}/output",
                                                   headers={"accept": "text/event-stream"})))
