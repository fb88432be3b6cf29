"""An agent's secrets (and an end-user's own): set, list, remove. Values go in, never out.

Scope ``secrets`` (an ``admin`` key holds it too). Responses carry names, versions and times, never values.
"""

from __future__ import annotations

from typing import Any

from moorage.api import schemas as S
from moorage.api.routes._common import agent_of, known_user
from moorage.api.routing import Call, Endpoint
from moorage.store.model import check_id

SECRET = S.obj({"agent": S.STR, "user": S.NSTR, "name": S.STR, "version": S.INT, "created_at": S.NUM,
                "updated_at": S.NUM})
NAME = {"type": "string", "pattern": r"^[A-Z_][A-Z0-9_]{0,127}$"}


def _store(call: Call) -> Any:
    """The host's secret store: the runtime's (it decrypts for ctx.fetch with the same keys), else this app's."""
    if call.ctx.runtime is not None:
        from moorage.runtime.host_calls import secrets_of

        return secrets_of(call.ctx.runtime)
    store = getattr(call.ctx, "secrets", None)
    if store is None:
        from moorage.secrets import SecretStore

        store = call.ctx.secrets = SecretStore.from_config(call.ctx.config)  # type: ignore[attr-defined]
    return store


def _render(info: Any) -> dict[str, Any]:
    return {"agent": info.agent, "user": info.user, "name": info.name, "version": info.version,
            "created_at": info.created_at, "updated_at": info.updated_at}


def _user(call: Call) -> str | None:
    user = call.path.get("user")
    return None if user is None else check_id(user, "user id")


def list_secrets(call: Call) -> dict[str, Any]:
    agent, user = agent_of(call), _user(call)
    listed = _store(call).list(call.tenant, agent.name, user)
    if user is not None and not listed:  # none of their own: for a user the agent has, not for a mistyped id
        known_user(call, agent.name, user)
    return {"data": [_render(i) for i in listed]}


def set_secret(call: Call) -> dict[str, Any]:
    agent = agent_of(call)
    value = call.field("value", str)
    return _render(_store(call).set(call.tenant, agent.name, call.path["name"], value, _user(call)))


def remove_secret(call: Call) -> dict[str, Any]:
    agent = agent_of(call)
    _store(call).remove(call.tenant, agent.name, call.path["name"], _user(call))
    return {"removed": call.path["name"]}


_LIST = S.obj({"data": {"type": "array", "items": SECRET}})
_BODY = S.obj({"value": {"type": "string", "minLength": 1, "maxLength": 16384,
                         "description": "the secret; stored encrypted, never returned"}}, ["value"])


def _endpoints(base: str, who: str, op: str) -> list[Endpoint]:
    return [
        Endpoint("GET", base, list_secrets, f"List {who} secrets (names, versions, times; never values)", "secrets",
                 f"list{op}Secrets", scope="secrets", response=_LIST),
        Endpoint("PUT", base + "/{name}", set_secret, f"Set {who} secret (a new value is a new version)", "secrets",
                 f"set{op}Secret", scope="secrets", body=_BODY, response=SECRET),
        Endpoint("DELETE", base + "/{name}", remove_secret, f"Remove {who} secret", "secrets", f"remove{op}Secret",
                 scope="secrets", response=S.obj({"removed": S.STR})),
    ]


ENDPOINTS = (_endpoints("/v1/agents/{agent}/secrets", "an agent's", "Agent")
             + _endpoints("/v1/agents/{agent}/users/{user}/secrets", "one end-user's own", "User"))
