"""This tenant's API keys (created, listed and revoked through the backend's control tables) and the
check of key scopes."""

from __future__ import annotations

from typing import Sequence

from moorage.errors import InvalidInput
from moorage.store.model import API_KEY_SCOPES, ApiKey
from moorage.store.repos.common import _Repo


class ApiKeys(_Repo):
    """This tenant's API keys. Secrets are returned once, at creation; only hashes are stored."""

    def create(self, scopes: Sequence[str], label: str = "", agent: str | None = None) -> ApiKey:
        """A new key with ``scopes``; with ``agent`` it may act on that one agent of the tenant only."""
        self._ts.principal.require("admin")
        return self._ts._backend.create_api_key(self._ts.tenant_id, scopes, label, agent)

    def list(self) -> list[ApiKey]:
        return self._ts._backend.list_api_keys(self._ts.tenant_id)

    def revoke(self, key_id: str) -> None:
        self._ts.principal.require("admin")
        self._ts._backend.revoke_api_key(self._ts.tenant_id, key_id)


def _check_scopes(scopes: Sequence[str]) -> frozenset[str]:
    bad = [s for s in scopes if s not in API_KEY_SCOPES]
    if bad or not scopes:
        raise InvalidInput(f"unknown key scopes {bad or scopes!r}", hint=f"choose from {', '.join(API_KEY_SCOPES)}")
    return frozenset(scopes)
