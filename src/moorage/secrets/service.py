"""Secrets of a tenant's agents: set, list, remove, and (host-internal only) reveal for injection.

Values are encrypted before they reach the store and decrypted only where a header is added upstream
(the gateway, ``ctx.fetch``) or an agent opted into ``env``; no API, log line or span carries one.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Callable

from moorage.errors import InvalidInput, NotFound
from moorage.secrets.bindings import Bindings
from moorage.secrets.keyring import Keyring
from moorage.store.repos.secrets import SecretInfo, check_secret_name
from moorage.store.model import check_id

MAX_VALUE_BYTES = 16 * 1024


def _context(tenant_id: str, agent: str, user: str | None, name: str) -> bytes:
    # The ciphertext is bound to its owner: a row copied to another tenant, agent, user or name won't decrypt.
    return f"moorage-secret\x00{tenant_id}\x00{agent}\x00{user or ''}\x00{name}".encode()


def check_value(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidInput("a secret value must be a non-empty string")
    if len(value.encode()) > MAX_VALUE_BYTES:
        raise InvalidInput(f"a secret value is at most {MAX_VALUE_BYTES} bytes")
    if any(c in value for c in "\r\n\x00"):
        # It goes into an HTTP header: a line break would let it add headers of its own.
        raise InvalidInput("a secret value may not contain line breaks or NUL", hint="strip the trailing newline")
    return value


@dataclass
class SecretStore:
    """The host's one handle on secrets (holds the operator's keyring)."""

    keyring: Keyring
    #: Where the keys come from again when a secret names a key this process has not loaded (a rotation
    #: made by ``moorage secrets rotate-key`` while it ran).
    reload: Callable[[], Keyring] | None = None

    @classmethod
    def from_config(cls, cfg: Any) -> "SecretStore":
        return cls(Keyring.from_config(cfg), lambda: Keyring.from_config(cfg))

    def _decrypt(self, blob: bytes, context: bytes) -> bytes:
        if not self.keyring.knows(blob) and self.reload is not None:
            self.keyring = self.reload()
        return self.keyring.decrypt(blob, context)

    def set(self, ts: Any, agent: str, name: str, value: str, user: str | None = None) -> SecretInfo:
        check_id(agent, "agent name")
        check_secret_name(name)
        blob, kid = self.keyring.encrypt(check_value(value).encode(), _context(ts.tenant_id, agent, user, name))
        return ts.secrets.put(agent, user, name, blob, kid)

    def list(self, ts: Any, agent: str, user: str | None = None) -> list[SecretInfo]:
        return ts.secrets.list(agent, user)

    def remove(self, ts: Any, agent: str, name: str, user: str | None = None) -> None:
        if not ts.secrets.delete(agent, user, name):
            raise NotFound(f"no secret {name!r} for agent {agent!r}" + (f" and user {user!r}" if user else ""),
                           hint="list them with `moorage secrets list AGENT`")

    def reveal(self, ts: Any, agent: str, name: str, user: str | None = None) -> str | None:
        """The value an instance of ``agent`` for ``user`` uses: the user's own secret, else the agent's."""
        for owner in ((user, None) if user else (None,)):
            found = ts.secrets.ciphertext(agent, owner, name)
            if found is not None:
                blob, _ = found
                return self._decrypt(blob, _context(ts.tenant_id, agent, owner, name)).decode()
        return None

    def headers(self, ts: Any, agent: str, user: str | None, bindings: Bindings, host: str, port: int) -> dict[str, str]:
        """Headers to add to a request for ``host:port`` (bound secrets that are set; unset ones are skipped)."""
        out: dict[str, str] = {}
        for b in bindings.for_host(host, port):
            value = self.reveal(ts, agent, b.name, user)
            if value is not None:
                out[b.header] = b.render(value)
        return out

    def header_source(self, ts: Any, agent: str, user: str | None, manifest: dict[str, Any] | None) -> Any:
        """What an instance's egress calls for the headers of a request (``InstanceEgress.headers``): its
        agent's bindings, values read (and decrypted) only for a request to a bound host."""
        bindings = Bindings.from_manifest(manifest)

        async def headers(t: Any) -> dict[str, str]:
            if not bindings.for_host(t.host, t.port):
                return {}
            return await asyncio.to_thread(self.headers, ts, agent, user, bindings, t.host, t.port)

        return headers

    def env(self, ts: Any, agent: str, user: str | None, bindings: Bindings) -> dict[str, str]:
        """The opted-in secrets for the guest's environment (``[agent.secrets] env``)."""
        out = {}
        for name in bindings.env:
            value = self.reveal(ts, agent, name, user)
            if value is not None:
                out[name] = value
        return out

    def reencrypt(self, ts: Any) -> int:
        """Move every secret of the tenant under the primary key (after a key rotation). Returns how many."""
        moved = 0
        for info, blob in list(ts.secrets.encrypted()):
            if info.key_id == self.keyring.primary:
                continue
            ctx = _context(ts.tenant_id, info.agent, info.user, info.name)
            new, kid = self.keyring.encrypt(self._decrypt(blob, ctx), ctx)
            moved += ts.secrets.reencrypt(info, new, kid)
        return moved
