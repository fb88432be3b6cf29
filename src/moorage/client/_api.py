"""The public routes as typed methods, written once: each builds a ``Request`` and hands it to ``_send``, which
the sync client answers with the value and the async client with an awaitable of it.

Shapes of the answers are in ``moorage.client.types``; every route is described in docs/api.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Mapping, Sequence

from moorage.client import types as T
from moorage.client._api_reach import ReachApi
from moorage.client._request import Request, _idem, _p, _page

#: Statuses an execution never leaves (``timed_out`` and ``interrupted`` are an exec's only).
TERMINAL = ("succeeded", "failed", "cancelled", "timed_out", "interrupted")


def _deploy(agent: str, source: bytes | str | Path, headers: dict[str, str], query: dict[str, str] | None = None) -> Request:
    return Request("POST", f"/v1/agents/{_p(agent)}/deployments", query or {}, content=_archive(source), headers=headers)


def _archive(source: bytes | str | Path) -> bytes:
    """What ``deploy`` uploads: the bytes given, a file's (a ready ``tar.gz``), or a directory packed here."""
    if isinstance(source, bytes):
        return source
    import io
    import tarfile

    root = Path(source)
    if root.is_file():
        return root.read_bytes()  # the server checks it is an agent package
    if not root.is_dir():
        raise FileNotFoundError(f"no agent directory or package at {str(root)!r}")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for p in sorted(root.rglob("*")):
            if p.is_file() and "__pycache__" not in p.parts and ".git" not in p.parts:
                tar.add(p, arcname=str(p.relative_to(root)))
    return buf.getvalue()


class Api(ReachApi, ABC):
    """Typed methods for the public routes (those for secrets, share links and the fleet in ``ReachApi``). ``_send`` is supplied by ``Client`` / ``AsyncClient``."""

    @abstractmethod
    def _send(self, req: Request) -> Any:
        """Send one request (the sync client returns its result, the async one an awaitable of it)."""

    # -- agents and deployments ----------------------------------------------------------------------------

    def list_agents(self, *, limit: int | None = None, cursor: str | None = None) -> T.Page[T.Agent]:
        return self._send(Request("GET", "/v1/agents", _page(limit, cursor)))

    def get_agent(self, agent: str) -> T.Agent:
        return self._send(Request("GET", f"/v1/agents/{_p(agent)}"))

    def delete_agent(self, agent: str) -> T.AgentDeleted:
        """Delete ``agent``: every end-user of it forgotten with everything it kept, its deployments, and the agent
        (its name free for a new one). Turns, users and deploys are refused meanwhile; a delete cut short is
        finished by sending it again."""
        return self._send(Request("DELETE", f"/v1/agents/{_p(agent)}"))

    def deploy(self, agent: str, source: bytes | str | Path, *, idempotency_key: str | None = None) -> T.Deployment:
        """Deploy an agent directory (packed here) or a ready ``tar.gz``; the server validates and builds it (see
        ``deploy_stream`` for the build's progress as it goes)."""
        return self._send(_deploy(agent, source, {"content-type": "application/gzip", **_idem(idempotency_key)}))

    def list_deployments(self, agent: str, *, limit: int | None = None, cursor: str | None = None) -> T.Page[T.Deployment]:
        return self._send(Request("GET", f"/v1/agents/{_p(agent)}/deployments", _page(limit, cursor)))

    def delete_deployment(self, agent: str, number: int) -> T.Deployment:
        """Delete deployment ``number`` of ``agent`` (not the live one, not one building): it is no longer listed
        nor a rollback's target, and its package stops counting toward the tenant's storage. Returns it, deleted."""
        return self._send(Request("DELETE", f"/v1/agents/{_p(agent)}/deployments/{_p(str(number))}"))

    def rollback(self, agent: str, number: int | None = None) -> T.Deployment:
        return self._send(Request("POST", f"/v1/agents/{_p(agent)}/rollback",
                                  json={} if number is None else {"number": number}))

    def get_retention(self, agent: str) -> T.Retention:
        """The agent's own data retention (``ttl_s`` None: none of its own)."""
        return self._send(Request("GET", f"/v1/agents/{_p(agent)}/retention"))

    def set_retention(self, agent: str, ttl_s: float | None = None, *,
                      zero_retention: bool | None = None) -> T.Retention:
        """Delete the agent's sessions, users and runs once idle ``ttl_s`` seconds (None clears it); or, with
        ``zero_retention=True``, keep nothing of its turns once they end (False turns that off again)."""
        body: dict[str, Any] = {"ttl_s": ttl_s}
        if zero_retention is not None:
            body = {"zero_retention": zero_retention, **({"ttl_s": ttl_s} if ttl_s is not None else {})}
        return self._send(Request("PUT", f"/v1/agents/{_p(agent)}/retention", json=body))

    def get_tenant_retention(self) -> T.TenantRetention:
        """The tenant's TTL per kind (None: kept) and the agents with a retention of their own."""
        return self._send(Request("GET", "/v1/retention"))

    def set_tenant_retention(self, ttl_s: Mapping[str, float | None]) -> T.TenantRetention:
        """Set or clear the TTL of the given kinds (``session``, ``user``, ``workflow``: idle seconds;
        ``executions``, ``usage``: the record's age, usage at least 31 days); others stay."""
        return self._send(Request("PUT", "/v1/retention", json={"ttl_s": dict(ttl_s)}))

    # -- end-users ------------------------------------------------------------------------------------------

    def put_user(self, agent: str, user: str, *, metadata: Mapping[str, Any] | None = None,
                 limits: Mapping[str, float | None] | None = None, provision: bool = False) -> T.User:
        """Get or create ``user`` (the product's own id); given metadata/limits replace the stored ones."""
        body: dict[str, Any] = {}
        if metadata is not None:
            body["metadata"] = dict(metadata)
        if limits is not None:
            body["limits"] = dict(limits)
        return self._send(Request("PUT", f"/v1/agents/{_p(agent)}/users/{_p(user)}",
                                  {"provision": "true"} if provision else {}, json=body))

    def get_user(self, agent: str, user: str) -> T.User:
        return self._send(Request("GET", f"/v1/agents/{_p(agent)}/users/{_p(user)}"))

    def list_users(self, agent: str, *, metadata: Mapping[str, Any] | None = None, limit: int | None = None,
                   cursor: str | None = None) -> T.Page[T.User]:
        """One page of the agent's users; ``metadata={"plan": "pro"}`` keeps users whose metadata has those values."""
        import json as _json

        extra = {f"metadata.{k}": v if isinstance(v, str) else _json.dumps(v) for k, v in (metadata or {}).items()}
        return self._send(Request("GET", f"/v1/agents/{_p(agent)}/users", _page(limit, cursor, **extra)))

    def delete_user(self, agent: str, user: str) -> T.Forgotten:
        """Forget everything stored about ``user`` of ``agent`` and remove the user."""
        return self._send(Request("DELETE", f"/v1/agents/{_p(agent)}/users/{_p(user)}"))

    def issue_user_token(self, agent: str, user: str, *, ttl_s: float | None = None) -> T.UserToken:
        return self._send(Request("POST", f"/v1/agents/{_p(agent)}/users/{_p(user)}/tokens",
                                  json={} if ttl_s is None else {"ttl_s": ttl_s}, shown_once="token",
                                  shown_once_hint="issue another token"))

    # -- turns and executions -------------------------------------------------------------------------------

    def invoke(self, agent: str, message: str, *, user: str | None = None, session: str | None = None,
               idempotency_key: str | None = None) -> T.Turn:
        """Run one turn and wait for its result (see ``invoke_async`` for long turns)."""
        return self._send(Request("POST", f"/v1/agents/{_p(agent)}/invoke", json=_turn_body(message, user, session),
                                  headers=_idem(idempotency_key)))

    def invoke_async(self, agent: str, message: str, *, user: str | None = None, session: str | None = None,
                     idempotency_key: str | None = None) -> T.Execution:
        """Start a turn detached: the answer (202) is its execution; poll ``get_execution`` or
        ``wait_execution``, or receive the agent's webhooks."""
        return self._send(Request("POST", f"/v1/agents/{_p(agent)}/invoke", {"async": "true"},
                                  json=_turn_body(message, user, session), headers=_idem(idempotency_key)))

    def get_execution(self, execution_id: str) -> T.Execution:
        return self._send(Request("GET", f"/v1/executions/{_p(execution_id)}"))

    # -- memory ---------------------------------------------------------------------------------------------

    def list_sessions(self, agent: str, *, user: str | None = None, limit: int | None = None,
                      cursor: str | None = None) -> T.Page[dict[str, Any]]:
        return self._send(Request("GET", f"/v1/agents/{_p(agent)}/sessions", _page(limit, cursor, user=user)))

    def list_events(self, agent: str, user: str, *, session: str | None = None, limit: int | None = None,
                    cursor: str | None = None, order: str | None = None, kind: str | None = None) -> T.Page[dict[str, Any]]:
        """The episodic log, oldest first; ``order="newest"`` reads it back from its end; ``kind`` filters."""
        return self._send(Request("GET", f"/v1/agents/{_p(agent)}/users/{_p(user)}/events",
                                  _page(limit, cursor, session=session, order=order, kind=kind)))

    def search_events(self, agent: str, user: str, query: str, *, k: int | None = None,
                      session: str | None = None) -> T.Page[T.SearchHit]:
        """Up to ``k`` events, best first, each in the shape ``ctx.memory.recall`` returns (docs/memory.md)."""
        return self._send(Request("GET", f"/v1/agents/{_p(agent)}/users/{_p(user)}/events/search",
                                  {k2: v for k2, v in {"q": query, "k": k, "session": session}.items() if v is not None}))

    def list_facts(self, agent: str, user: str, *, limit: int | None = None,
                   cursor: str | None = None, **filters: Any) -> T.Page[dict[str, Any]]:
        return self._send(Request("GET", f"/v1/agents/{_p(agent)}/users/{_p(user)}/facts",
                                  _page(limit, cursor, **filters)))

    def add_fact(self, agent: str, user: str, subject: str, attribute: str, value: str,
                 text: str | None = None) -> dict[str, Any]:
        body = {"subject": subject, "attribute": attribute, "value": value, **({"text": text} if text else {})}
        return self._send(Request("POST", f"/v1/agents/{_p(agent)}/users/{_p(user)}/facts", json=body))

    def list_pending_facts(self, agent: str, user: str, *, session: str | None = None, limit: int | None = None,
                           cursor: str | None = None) -> T.Page[dict[str, Any]]:
        """The user's facts waiting for confirmation (what the agent ``learn``ed, tool output), oldest first."""
        return self._send(Request("GET", f"/v1/agents/{_p(agent)}/users/{_p(user)}/facts/pending",
                                  _page(limit, cursor, session=session)))

    def confirm_fact(self, agent: str, user: str, fact_id: str, *, session: str | None = None,
                     idempotency_key: str | None = None) -> dict[str, Any]:
        """Confirm a pending fact: current from now on; ``previous`` is the value it superseded, if any."""
        return self._send(Request("POST", f"/v1/agents/{_p(agent)}/users/{_p(user)}/facts/{_p(fact_id)}/confirm",
                                  {"session": session} if session else {}, headers=_idem(idempotency_key)))

    def reject_fact(self, agent: str, user: str, fact_id: str, *, session: str | None = None,
                    idempotency_key: str | None = None) -> dict[str, Any]:
        """Reject a pending fact: it is never believed (kept as ``rejected`` for the record)."""
        return self._send(Request("POST", f"/v1/agents/{_p(agent)}/users/{_p(user)}/facts/{_p(fact_id)}/reject",
                                  {"session": session} if session else {}, headers=_idem(idempotency_key)))

    # -- checkpoints of a user's instance (time travel) ------------------------------------------------------

    def list_checkpoints(self, agent: str, user: str, *, limit: int | None = None,
                         cursor: str | None = None) -> dict[str, Any]:
        """The instance's checkpoints, newest first, with what each turn did; its branches and storage."""
        return self._send(Request("GET", f"/v1/agents/{_p(agent)}/users/{_p(user)}/checkpoints", _page(limit, cursor)))

    def take_checkpoint(self, agent: str, user: str, *, name: str | None = None) -> dict[str, Any]:
        body = {"name": name} if name is not None else {}
        return self._send(Request("POST", f"/v1/agents/{_p(agent)}/users/{_p(user)}/checkpoints", json=body))

    def rollback_checkpoint(self, agent: str, user: str, checkpoint_id: str, *,
                            idempotency_key: str | None = None) -> dict[str, Any]:
        """Roll the instance (sandbox and store state) back; what came after stays as an abandoned branch."""
        return self._send(Request("POST", f"/v1/agents/{_p(agent)}/users/{_p(user)}/checkpoints/{_p(checkpoint_id)}"
                                  "/rollback", json={}, headers=_idem(idempotency_key)))

    def fork_checkpoint(self, agent: str, user: str, checkpoint_id: str, to_users: str | Sequence[str], *,
                        idempotency_key: str | None = None) -> dict[str, Any]:
        """New end-users of the agent, each starting from the checkpoint (sandbox and store state copied)."""
        users = [to_users] if isinstance(to_users, str) else list(to_users)
        return self._send(Request("POST", f"/v1/agents/{_p(agent)}/users/{_p(user)}/checkpoints/{_p(checkpoint_id)}"
                                  "/fork", json={"to_users": users}, headers=_idem(idempotency_key)))

    # -- workflows ------------------------------------------------------------------------------------------

    def list_workflows(self, *, status: str | None = None, agent: str | None = None, user: str | None = None,
                       limit: int | None = None, cursor: str | None = None) -> T.Page[dict[str, Any]]:
        """Runs by last change, oldest first; ``user`` (with ``agent``): one end-user's, e.g. their waiting turns."""
        return self._send(Request("GET", "/v1/workflows", _page(limit, cursor, status=status, agent=agent, user=user)))

    def get_workflow(self, run_id: str) -> dict[str, Any]:
        return self._send(Request("GET", f"/v1/workflows/{_p(run_id)}"))

    def answer(self, run_id: str, answer: Any) -> T.Turn:
        """Give a waiting run (an interrupt) its human answer; the turn resumes from there."""
        return self._send(Request("POST", f"/v1/workflows/{_p(run_id)}/answer", json={"answer": answer}))

    def cancel(self, run_id: str) -> dict[str, Any]:
        return self._send(Request("POST", f"/v1/workflows/{_p(run_id)}/cancel", json={}))

    # -- webhooks -------------------------------------------------------------------------------------------

    def create_webhook(self, agent: str, url: str, *, events: Sequence[str] | None = None,
                       secret: str | None = None) -> T.Webhook:
        """Subscribe ``url`` to the agent's events; the answer holds the ``whsec_`` secret (shown once)."""
        body: dict[str, Any] = {"url": url}
        if events is not None:
            body["events"] = list(events)
        if secret is not None:
            body["secret"] = secret
        return self._send(Request("POST", f"/v1/agents/{_p(agent)}/webhooks", json=body, shown_once="secret",
                                  shown_once_hint="delete webhook {id} and create it again (or pass your own secret)"))

    def list_webhooks(self, agent: str) -> T.Page[T.Webhook]:
        return self._send(Request("GET", f"/v1/agents/{_p(agent)}/webhooks"))

    def get_webhook(self, agent: str, webhook_id: str) -> T.Webhook:
        return self._send(Request("GET", f"/v1/agents/{_p(agent)}/webhooks/{_p(webhook_id)}"))

    def delete_webhook(self, agent: str, webhook_id: str) -> dict[str, Any]:
        return self._send(Request("DELETE", f"/v1/agents/{_p(agent)}/webhooks/{_p(webhook_id)}"))

    def list_deliveries(self, agent: str, webhook_id: str, *, limit: int | None = None,
                        cursor: str | None = None) -> T.Page[T.Delivery]:
        return self._send(Request("GET", f"/v1/agents/{_p(agent)}/webhooks/{_p(webhook_id)}/deliveries",
                                  _page(limit, cursor)))

    def get_delivery(self, agent: str, webhook_id: str, delivery_id: str) -> T.Delivery:
        return self._send(Request("GET", f"/v1/agents/{_p(agent)}/webhooks/{_p(webhook_id)}/deliveries/{_p(delivery_id)}"))

    def replay_delivery(self, agent: str, webhook_id: str, delivery_id: str) -> T.Delivery:
        return self._send(Request(
            "POST", f"/v1/agents/{_p(agent)}/webhooks/{_p(webhook_id)}/deliveries/{_p(delivery_id)}/replay", json={}))

    # -- keys, sandboxes, traces, usage ---------------------------------------------------------------------

    def whoami(self) -> T.Whoami:
        """What this client's credential is and may do: ``kind`` (key or end-user), scopes, agent, user."""
        return self._send(Request("GET", "/v1/whoami"))

    def list_keys(self, *, limit: int | None = None, cursor: str | None = None) -> T.Page[T.ApiKey]:
        return self._send(Request("GET", "/v1/keys", _page(limit, cursor)))

    def create_key(self, scopes: Sequence[str], *, label: str = "", agent: str | None = None) -> T.ApiKey:
        body: dict[str, Any] = {"scopes": list(scopes), "label": label}
        if agent is not None:
            body["agent"] = agent
        return self._send(Request("POST", "/v1/keys", json=body, shown_once="secret",
                                  shown_once_hint="revoke key {id} and create another"))

    def revoke_key(self, key_id: str) -> dict[str, Any]:
        return self._send(Request("DELETE", f"/v1/keys/{_p(key_id)}"))

    def list_sandboxes(self, *, state: str | None = None, agent: str | None = None, limit: int | None = None,
                       cursor: str | None = None) -> T.Page[dict[str, Any]]:
        """``agent``: that agent's sandboxes only (a key limited to one agent must name it)."""
        return self._send(Request("GET", "/v1/sandboxes", _page(limit, cursor, state=state, agent=agent)))

    def get_sandbox(self, sandbox_id: str) -> dict[str, Any]:
        return self._send(Request("GET", f"/v1/sandboxes/{_p(sandbox_id)}"))

    def sandbox_action(self, sandbox_id: str, verb: str, *, label: str | None = None,
                       to_users: str | Sequence[str] | None = None) -> dict[str, Any]:
        """``sleep``, ``wake``, ``checkpoint``, ``rollback`` or ``fork`` of the sandbox's instance. The last three are
        the whole instance's (sandbox and memory): ``label`` names the checkpoint taken, or the one to roll back to
        (its id or name); ``fork`` makes new end-users ``to_users``, each starting as the instance is now."""
        body: dict[str, Any] = {} if label is None else {"label": label}
        if to_users is not None:
            body["to_users"] = [to_users] if isinstance(to_users, str) else list(to_users)
        return self._send(Request("POST", f"/v1/sandboxes/{_p(sandbox_id)}/{_p(verb)}", json=body))

    def list_files(self, sandbox_id: str, path: str) -> dict[str, Any]:
        return self._send(Request("GET", f"/v1/sandboxes/{_p(sandbox_id)}/files", {"path": path}))

    def read_file(self, sandbox_id: str, path: str) -> dict[str, Any]:
        return self._send(Request("GET", f"/v1/sandboxes/{_p(sandbox_id)}/files/content", {"path": path}))

    def exec(self, sandbox_id: str, argv: Sequence[str], *, timeout_s: float | None = None, cwd: str | None = None,
             env: Mapping[str, str] | None = None) -> T.ExecResult:
        """Run a command in the sandbox and wait for it (``timeout_s`` defaults to 60 on the server). The server runs it
        again if it is sent again, so it is retried only when it surely did not run (a 429 or 503 answer, no
        connection made); otherwise the error says it may have run (``exec_detached`` with a key is safe to repeat)."""
        return self._send(Request("POST", f"/v1/sandboxes/{_p(sandbox_id)}/exec",
                                  json=_exec_body(argv, timeout_s, cwd, env, detach=False), repeats=True))

    def exec_detached(self, sandbox_id: str, argv: Sequence[str], *, timeout_s: float | None = None,
                      cwd: str | None = None, env: Mapping[str, str] | None = None,
                      idempotency_key: str | None = None) -> T.ExecExecution:
        """Start a command in the sandbox and answer at once with its execution (``kind == "exec"``): follow it
        with ``follow_exec``, wait with ``wait``, stop it with ``cancel_execution``."""
        return self._send(Request("POST", f"/v1/sandboxes/{_p(sandbox_id)}/exec",
                                  json=_exec_body(argv, timeout_s, cwd, env, detach=True), headers=_idem(idempotency_key)))

    def cancel_execution(self, execution_id: str) -> T.ExecExecution:
        """Kill a running detached exec (its whole process group); it ends ``cancelled``."""
        return self._send(Request("POST", f"/v1/executions/{_p(execution_id)}/cancel", json={}))

    def list_spans(self, *, limit: int | None = None, cursor: str | None = None,
                   agent: str | None = None) -> T.Page[dict[str, Any]]:
        """Recent spans of the tenant, newest first (requests, turns, lifecycle transitions); ``agent``: that
        agent's only (a key limited to one agent must name it)."""
        return self._send(Request("GET", "/v1/traces", _page(limit, cursor, agent=agent)))

    def get_trace(self, trace_id: str) -> dict[str, Any]:
        return self._send(Request("GET", f"/v1/traces/{_p(trace_id)}"))

    def usage(self, *, since: float | None = None, agent: str | None = None, user: str | None = None,
              by_day: bool = False, until: float | None = None) -> T.Usage:
        """Usage totals (``compute_seconds``, tokens, ``cost_usd``, …) of ``[since, until)`` (epoch seconds; windows
        that meet count each row once); ``by_day`` adds ``days`` (UTC); ``agent``:
        that agent's only (a key limited to one agent must name it); with ``agent`` and ``user``, ``caps``: each of
        the user's caps with its ``limit``, ``used`` (as the check before a turn counts it) and ``resets_at``."""
        params = {k: v for k, v in {"since": since, "until": until, "agent": agent, "user": user}.items()
                  if v is not None}
        if by_day:
            params["group"] = "day"
        return self._send(Request("GET", "/v1/usage", params))

    def health(self) -> dict[str, Any]:
        return self._send(Request("GET", "/healthz"))


def _exec_body(argv: Sequence[str], timeout_s: float | None, cwd: str | None, env: Mapping[str, str] | None, *,
               detach: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"argv": list(argv), "detach": detach}
    if timeout_s is not None:
        body["timeout_s"] = timeout_s
    if cwd is not None:
        body["cwd"] = cwd
    if env is not None:
        body["env"] = dict(env)
    return body


def _turn_body(message: str, user: str | None, session: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"message": message}
    if user is not None:
        body["user"] = user
    if session is not None:
        body["session"] = session
    return body
