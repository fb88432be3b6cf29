"""The routes a backend uses to let an agent reach the world and be reached: secrets (an agent's, one end-user's),
share links to a user's app, and the fleet's summary. Mixed into ``Api``; the shapes are in ``moorage.client.types``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from moorage.client import types as T
from moorage.client._request import Request, _p


class ReachApi(ABC):
    @abstractmethod
    def _send(self, req: Request) -> Any:
        """Send one request (the sync client returns its result, the async one an awaitable of it)."""

    # -- secrets: values go in, never come out ---------------------------------------------------------------

    @staticmethod
    def _secrets(agent: str, user: str | None) -> str:
        base = f"/v1/agents/{_p(agent)}"
        return f"{base}/users/{_p(user)}/secrets" if user is not None else f"{base}/secrets"

    def list_secrets(self, agent: str, *, user: str | None = None) -> T.Page[T.Secret]:
        """The agent's secrets (names, versions, times; never values), or with ``user`` that end-user's own."""
        return self._send(Request("GET", self._secrets(agent, user)))

    def set_secret(self, agent: str, name: str, value: str, *, user: str | None = None) -> T.Secret:
        """Set a secret (``NAME`` in capitals; a new value is a new version), the agent's or with ``user`` that
        end-user's own. It reaches an upstream only where the agent binds it (docs/egress.md)."""
        return self._send(Request("PUT", f"{self._secrets(agent, user)}/{_p(name)}", json={"value": value}))

    def delete_secret(self, agent: str, name: str, *, user: str | None = None) -> dict[str, Any]:
        return self._send(Request("DELETE", f"{self._secrets(agent, user)}/{_p(name)}"))

    # -- share links to one user's app ----------------------------------------------------------------------

    def create_share_link(self, agent: str, user: str, *, ttl_s: float | None = None,
                          label: str | None = None) -> T.ShareLink:
        """A link that opens ``user``'s app without a key (``url``, relative to the server; its ``token`` is shown
        once) for ``ttl_s`` seconds (the server's default: an hour)."""
        body: dict[str, Any] = {}
        if ttl_s is not None:
            body["ttl_s"] = ttl_s
        if label is not None:
            body["label"] = label
        return self._send(Request("POST", f"/v1/agents/{_p(agent)}/users/{_p(user)}/share-links", json=body,
                                  shown_once="token", shown_once_hint="revoke share link {id} and create another"))

    def list_share_links(self, agent: str, user: str) -> T.Page[T.ShareLink]:
        """The user's share links, revoked and expired ones included (never their tokens)."""
        return self._send(Request("GET", f"/v1/agents/{_p(agent)}/users/{_p(user)}/share-links"))

    def revoke_share_link(self, agent: str, user: str, link_id: str) -> T.ShareLink:
        return self._send(Request("DELETE", f"/v1/agents/{_p(agent)}/users/{_p(user)}/share-links/{_p(link_id)}"))

    # -- the fleet ------------------------------------------------------------------------------------------

    def fleet(self, *, agent: str | None = None, since: float | None = None,
              limit: int | None = None) -> dict[str, Any]:
        """The tenant's instances by state with their activity, wake latency, RAM and disk, and the cost split;
        ``agent``: that agent's only (a key limited to one agent must name it); ``since``: epoch seconds (default
        30 days ago); ``limit``: most instances listed (default 200)."""
        params = {k: v for k, v in {"agent": agent, "since": since, "limit": limit}.items() if v is not None}
        return self._send(Request("GET", "/v1/fleet", params))
