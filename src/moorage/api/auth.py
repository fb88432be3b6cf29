"""Credentials: tenant API keys (``mrg_...``), end-user tokens (``mrgu_...``) and the operator token.

The tenant, agent and user of a request come only from a verified credential, never from a header,
path or body. End-user tokens are HMAC-signed with a per-installation secret kept in the data dir.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from moorage.errors import NotFound, TenantScopeError, Unauthenticated
from moorage.store import Principal, Store
from moorage.store.model import check_id

USER_TOKEN_PREFIX = "mrgu_"
#: End-user tokens live at most this long; issue a fresh one rather than a long-lived one.
MAX_USER_TOKEN_TTL_S = 30 * 24 * 3600
DEFAULT_USER_TOKEN_TTL_S = 3600


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def load_or_create_secret(path: Path, nbytes: int = 32) -> str:
    """Read a secret file, creating it (mode 0600, never overwritten) on first use."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text().strip()
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(nbytes))
        f.flush()
        os.fsync(f.fileno())
    return path.read_text().strip()


@dataclass(frozen=True)
class UserToken:
    token: str
    agent: str
    user: str
    expires_at: float


class Authenticator:
    """Turns an ``Authorization`` header into a ``Principal`` (or the operator), and signs end-user tokens."""

    def __init__(self, store: Store, signing_secret: str, operator_token: str) -> None:
        self.store = store
        self._key = hashlib.sha256(b"moorage-user-token\0" + signing_secret.encode()).digest()
        self._operator_token = operator_token

    @classmethod
    def for_data_dir(cls, store: Store, data_dir: Path) -> "Authenticator":
        """Secrets live in ``<data_dir>/api/``; frontends sharing one store must share these two files."""
        return cls(store, load_or_create_secret(data_dir / "api" / "token-secret"),
                   load_or_create_secret(data_dir / "api" / "operator-token"))

    @staticmethod
    def bearer(header: str | None) -> str:
        if not header:
            raise Unauthenticated("no credential", hint="send `Authorization: Bearer mrg_...` (an API key) or an end-user token")
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "bearer" or not value.strip():
            raise Unauthenticated("malformed Authorization header", hint="use `Authorization: Bearer <key or token>`")
        return value.strip()

    def authenticate(self, header: str | None) -> Principal:
        secret = self.bearer(header)
        if secret.startswith(USER_TOKEN_PREFIX):
            return self._verify_user_token(secret)
        return self.store.authenticate(secret)

    def require_operator(self, header: str | None) -> None:
        given = self.bearer(header)
        if not hmac.compare_digest(given.encode(), self._operator_token.encode()):
            raise Unauthenticated("this route needs the operator token",
                                  hint="find it in <data_dir>/api/operator-token on the moorage host")

    # -- end-user tokens ---------------------------------------------------------------------------

    def issue_user_token(self, principal: Principal, agent: str, user: str, ttl_s: float | None = None) -> UserToken:
        """Sign a token that may act for ``user`` of ``agent`` only, in the principal's tenant."""
        if principal.user is not None:
            raise TenantScopeError("an end-user token cannot issue tokens", hint="use a tenant API key with deploy scope")
        if "admin" not in principal.scopes and "deploy" not in principal.scopes:
            raise TenantScopeError("issuing end-user tokens needs the admin or deploy scope",
                                   hint="use a key with the deploy scope")
        check_id(agent, "agent id")
        check_id(user, "user id")
        ttl = DEFAULT_USER_TOKEN_TTL_S if ttl_s is None else float(ttl_s)
        if not 0 < ttl <= MAX_USER_TOKEN_TTL_S:
            from moorage.errors import InvalidInput

            raise InvalidInput(f"ttl_s must be between 1 and {MAX_USER_TOKEN_TTL_S}", hint="issue short-lived tokens and refresh them")
        exp = int(time.time() + ttl)
        payload = {"v": 1, "t": principal.tenant_id, "a": agent, "u": user, "k": principal.key_id, "exp": exp,
                   "n": secrets.token_hex(6)}
        body = _b64(json.dumps(payload, separators=(",", ":"), sort_keys=True).encode())
        sig = _b64(hmac.new(self._key, body.encode(), hashlib.sha256).digest())
        return UserToken(f"{USER_TOKEN_PREFIX}{body}.{sig}", agent, user, float(exp))

    def _verify_user_token(self, token: str) -> Principal:
        bad = Unauthenticated("invalid end-user token", hint="ask the application for a fresh token")
        body, _, sig = token.removeprefix(USER_TOKEN_PREFIX).partition(".")
        if not body or not sig or len(token) > 2048:
            raise bad
        expected = _b64(hmac.new(self._key, body.encode(), hashlib.sha256).digest())
        if not hmac.compare_digest(expected.encode(), sig.encode()):
            raise bad
        try:
            p = json.loads(_unb64(body))
            tenant, agent, user, exp, key_id = p["t"], p["a"], p["u"], float(p["exp"]), p.get("k")
        except (ValueError, KeyError, TypeError) as e:
            raise bad from e
        if exp <= time.time():
            raise Unauthenticated("end-user token expired", hint="ask the application for a fresh token")
        try:
            self.store.operator.get_tenant(tenant)
        except NotFound as e:
            raise bad from e
        # A token dies with the key that issued it: revoking a leaked key revokes its tokens too.
        if key_id is not None and not any(
            k.id == key_id and (k.revoked_at is None or k.revoked_at > time.time()) for k in self.store.backend.list_api_keys(tenant)
        ):
            raise Unauthenticated("the key that issued this token was revoked", hint="ask the application for a fresh token")
        return Principal(tenant, frozenset({"invoke"}), key_id=f"user-token:{key_id}", agent=agent, user=user)
