"""Credentials: tenant API keys (``mrg_...``), end-user tokens (``mrgu_...``) and the operator token.

The tenant, agent and user of a request come only from a verified credential, never from a header,
path or body. End-user tokens are HMAC-signed with a per-installation secret kept in the data dir.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import hmac
import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from moorage.errors import ConfigError, InvalidInput, NotFound, TenantScopeError, Unauthenticated
from moorage.log import get_logger
from moorage.store import Principal, Store
from moorage.store.model import check_id

log = get_logger(__name__)

USER_TOKEN_PREFIX = "mrgu_"
#: End-user tokens live at most this long; issue a fresh one rather than a long-lived one.
MAX_USER_TOKEN_TTL_S = 30 * 24 * 3600
DEFAULT_USER_TOKEN_TTL_S = 3600


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


#: A secret shorter than this was not written by moorage (``token_urlsafe(32)`` is 43 characters).
MIN_SECRET_CHARS = 32


def _read_secret(path: Path) -> str | None:
    """The secret in ``path``, ``None`` when the file is missing or empty (an interrupted legacy creation)."""
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    if not text:
        return None
    if len(text) < MIN_SECRET_CHARS:
        raise ConfigError(f"the secret file {path} holds only {len(text)} characters",
                          hint=f"delete it (a new one is created on the next start) or write at least "
                               f"{MIN_SECRET_CHARS} random characters into it; tokens signed with it stop working")
    if path.stat().st_mode & 0o077:
        os.chmod(path, 0o600)  # written by hand or by an older version: nobody but the owner may read it
    return text


def _install_secret(path: Path, text: str, *, replace: bool) -> None:
    """Write ``text`` to a private temp file, fsync it, then link it into place: readers see all or nothing."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)  # fails if a file appeared meanwhile: the existing one wins, never overwritten
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)  # the new name survives a crash too
    finally:
        os.close(dfd)


def load_or_create_secret(path: Path, nbytes: int = 32) -> str:
    """Read a secret file, creating it (mode 0600, directory 0700) on first use; never returns an empty secret.

    The file appears complete or not at all (temp file, fsync, link). Concurrent first openers, threads or
    processes, serialize on a lock file and all get the one secret written. An empty file, the trace of a
    crash in an older version's creation, is replaced under the same lock and logged.
    """
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    found = _read_secret(path)
    if found is not None:
        return found
    lock_fd = os.open(path.with_name(f".{path.name}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        found = _read_secret(path)  # another opener may have created it while we waited
        if found is not None:
            return found
        empty = path.exists()
        if empty:
            log.warning("secret file was empty (a creation was interrupted); writing a new one", path=str(path))
        try:
            _install_secret(path, secrets.token_urlsafe(nbytes), replace=empty)
        except FileExistsError:
            pass  # created by an opener that does not take the lock (another host on shared storage)
        found = _read_secret(path)
        if found is None:
            raise ConfigError(f"could not create the secret file {path}", hint="check that the data directory is writable")
        return found
    finally:
        os.close(lock_fd)  # closing releases the lock


def installation_fingerprints(config: Any) -> dict[str, Any]:
    """Fingerprints of the secrets every host of a fleet must share (the end-user token secret, the operator
    token, the agent-secrets keys), compared when a host joins (fleet/hosts.py); creates what is missing, as the
    API's first start would."""
    from moorage.fleet.hosts import fingerprints
    from moorage.secrets.keyring import Keyring

    api = Path(config.data_dir) / "api"
    return fingerprints(load_or_create_secret(api / "token-secret"), load_or_create_secret(api / "operator-token"),
                        list(Keyring.from_config(config).keys))


class TokenExpired(Unauthenticated):
    """An end-user token past its ``exp``: not a revocation (a turn it started may finish, ``credential_watch``)."""


@dataclass(frozen=True)
class UserToken:
    token: str
    agent: str
    user: str
    expires_at: float


class Authenticator:
    """Turns an ``Authorization`` header into a ``Principal`` (or the operator), and signs end-user tokens."""

    def __init__(self, store: Store, signing_secret: str, operator_token: str, metrics_token: str | None = None) -> None:
        if not signing_secret or not operator_token:
            raise ConfigError("the end-user token secret and the operator token must not be empty",
                              hint="delete the empty file under <data_dir>/api/; a new one is created on the next start")
        self.store = store
        self._key = hashlib.sha256(b"moorage-user-token\0" + signing_secret.encode()).digest()
        self._operator_token = operator_token
        self._metrics_token = metrics_token

    @classmethod
    def for_data_dir(cls, store: Store, data_dir: Path) -> "Authenticator":
        """Secrets live in ``<data_dir>/api/``; frontends sharing one store must share the token secret and the
        operator token. ``metrics-token`` only lets a scraper read ``/metrics``."""
        api = data_dir / "api"
        return cls(store, load_or_create_secret(api / "token-secret"), load_or_create_secret(api / "operator-token"),
                   load_or_create_secret(api / "metrics-token"))

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

    def require_metrics(self, header: str | None) -> None:
        """``/metrics``: the operator token, or the metrics token that can do nothing else."""
        given = self.bearer(header).encode()
        tokens = [self._operator_token] + ([self._metrics_token] if self._metrics_token else [])
        # Compare with every token (no early exit), so timing says nothing about which one nearly matched.
        if not sum(hmac.compare_digest(given, t.encode()) for t in tokens):
            raise Unauthenticated("/metrics needs the metrics token or the operator token",
                                  hint="point the scraper's credentials_file at <data_dir>/api/metrics-token")

    # -- end-user tokens ---------------------------------------------------------------------------

    def issue_user_token(self, principal: Principal, agent: str, user: str, ttl_s: float | None = None, *,
                         user_record: Callable[[], float | None] | None = None) -> UserToken:
        """Sign a token that may act for ``user`` of ``agent`` only, in the principal's tenant. ``user_record``,
        called once the request is known to be allowed, gives the creation time of the user's record (made now
        where the agent makes users as they come), or None where there is none: the token is tied to that record,
        refused once the user is forgotten, also when a new user of the same id is created later."""
        if principal.user is not None:
            raise TenantScopeError("an end-user token cannot issue tokens", hint="use a tenant API key with deploy scope")
        if "admin" not in principal.scopes and "deploy" not in principal.scopes:
            raise TenantScopeError("issuing end-user tokens needs the admin or deploy scope",
                                   hint="use a key with the deploy scope")
        if not principal.key_id:
            # The key id is what revocation checks: a token without one could never be revoked.
            raise TenantScopeError("only a tenant API key can issue end-user tokens", hint="use a key with the deploy scope")
        check_id(agent, "agent id")
        check_id(user, "user id")
        ttl = DEFAULT_USER_TOKEN_TTL_S if ttl_s is None else float(ttl_s)
        if not 0 < ttl <= MAX_USER_TOKEN_TTL_S:
            raise InvalidInput(f"ttl_s must be between 1 and {MAX_USER_TOKEN_TTL_S}", hint="issue short-lived tokens and refresh them")
        user_created_at = user_record() if user_record is not None else None
        exp = int(time.time() + ttl)
        payload = {"v": 1, "t": principal.tenant_id, "a": agent, "u": user, "k": principal.key_id, "exp": exp,
                   "n": secrets.token_hex(6), **({"c": user_created_at} if user_created_at is not None else {})}
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
            tenant, agent, user, exp, key_id = p["t"], p["a"], p["u"], float(p["exp"]), p["k"]
        except (ValueError, KeyError, TypeError) as e:
            raise bad from e
        # Every token names the key that issued it; one without is refused, so revocation always applies.
        if not isinstance(key_id, str) or not key_id or not isinstance(tenant, str):
            raise bad
        if exp <= time.time():
            raise TokenExpired("end-user token expired", hint="ask the application for a fresh token")
        try:
            self.store.operator.get_tenant(tenant)
        except NotFound as e:
            raise bad from e
        # A token dies with the key that issued it: revoking a leaked key revokes its tokens too.
        revoked = self.store.backend.key_revocations(tenant, [key_id])
        if key_id not in revoked or (revoked[key_id] is not None and revoked[key_id] <= time.time()):
            raise Unauthenticated("the key that issued this token was revoked", hint="ask the application for a fresh token")
        if "c" in p and not self._same_user(tenant, agent, user, p["c"]):
            # Forgotten since (and perhaps created again under the same id: another person, for all moorage knows).
            raise Unauthenticated("this end-user token was issued to a user who has since been forgotten",
                                  hint=f"ask the application for a fresh token (the application: create the user "
                                       f"again, PUT /v1/agents/{agent}/users/{user}, if they are to be served, then "
                                       f"issue a new token; a token issued before the forget stays refused)")
        return Principal(tenant, frozenset({"invoke"}), key_id=f"user-token:{key_id}", agent=agent, user=user)

    def _same_user(self, tenant: str, agent: object, user: object, created_at: object) -> bool:
        """Whether the user the token was issued to (their record's creation time) is still there."""
        if not isinstance(agent, str) or not isinstance(user, str) or not isinstance(created_at, (int, float)):
            return False
        rec = self.store.tenant(self.store.operator.principal(tenant)).agent_users.find(agent, user)
        return rec is not None and abs(rec.created_at - float(created_at)) < 1e-3
