"""The tenant's encrypted secrets: one row per (agent, end-user or none, name), ciphertext only.

This repository never sees a plaintext: ``moorage.secrets`` encrypts before ``put`` and decrypts after
``ciphertext``; listings return names, versions and timestamps only.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

from moorage.errors import InvalidInput
from moorage.store.model import check_id

if TYPE_CHECKING:
    from moorage.store.tenant import TenantStore

_NAME = re.compile(r"^[A-Z_][A-Z0-9_]{0,127}$")
_COLS = "agent_id, user_id, name, key_id, version, created_at, updated_at"


def check_secret_name(name: object) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidInput(f"malformed secret name {name!r}",
                           hint="use upper-case letters, digits and _ (like GITHUB_TOKEN), at most 128")
    return name


@dataclass(frozen=True)
class SecretInfo:
    """What anyone may know about a secret: never its value."""

    agent: str
    user: str | None
    name: str
    version: int
    created_at: float
    updated_at: float
    key_id: str


def _info(r: tuple) -> SecretInfo:
    return SecretInfo(r[0], r[1] or None, r[2], int(r[4]), float(r[5]), float(r[6]), r[3])


class Secrets:
    """``ts.secrets``: encrypted secret rows of this tenant."""

    def __init__(self, ts: "TenantStore") -> None:
        self._ts = ts

    @staticmethod
    def _key(agent: str, user: str | None, name: str) -> tuple[str, str, str]:
        return check_id(agent, "agent name"), "" if user is None else check_id(user, "user id"), check_secret_name(name)

    def put(self, agent: str, user: str | None, name: str, ciphertext: bytes, key_id: str) -> SecretInfo:
        """Create or replace one secret; its version goes up by one each time."""
        a, u, n = self._key(agent, user, name)
        now = time.time()
        with self._ts._tx() as c:
            cur = c.one("SELECT version, created_at FROM secrets WHERE agent_id = ? AND user_id = ? AND name = ?", (a, u, n))
            if cur is None:
                c.x(f"INSERT INTO secrets ({_COLS}, ciphertext) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (a, u, n, key_id, 1, now, now, c.blob(ciphertext)))
                return SecretInfo(a, user, n, 1, now, now, key_id)
            c.x("UPDATE secrets SET ciphertext = ?, key_id = ?, version = version + 1, updated_at = ? "
                "WHERE agent_id = ? AND user_id = ? AND name = ?", (c.blob(ciphertext), key_id, now, a, u, n))
            return SecretInfo(a, user, n, int(cur[0]) + 1, float(cur[1]), now, key_id)

    def list(self, agent: str, user: str | None = None) -> list[SecretInfo]:
        """Secrets of ``agent`` (agent-wide ones when ``user`` is None, else that user's own)."""
        a, u = check_id(agent, "agent name"), "" if user is None else check_id(user, "user id")
        with self._ts._tx(write=False) as c:
            rows = c.q(f"SELECT {_COLS} FROM secrets WHERE agent_id = ? AND user_id = ? ORDER BY name", (a, u))
        return [_info(r) for r in rows]

    def ciphertext(self, agent: str, user: str | None, name: str) -> tuple[bytes, SecretInfo] | None:
        a, u, n = self._key(agent, user, name)
        with self._ts._tx(write=False) as c:
            r = c.one(f"SELECT {_COLS}, ciphertext FROM secrets WHERE agent_id = ? AND user_id = ? AND name = ?", (a, u, n))
        return None if r is None else (bytes(r[7]), _info(r))

    def delete(self, agent: str, user: str | None, name: str) -> bool:
        a, u, n = self._key(agent, user, name)
        with self._ts._tx() as c:
            return c.x("DELETE FROM secrets WHERE agent_id = ? AND user_id = ? AND name = ?", (a, u, n)) == 1

    def delete_user(self, user: str, agent: str | None = None) -> int:
        """Forget one end-user's own secrets (of one agent, or of all)."""
        with self._ts._tx() as c:
            if agent is None:
                return c.x("DELETE FROM secrets WHERE user_id = ?", (check_id(user, "user id"),))
            return c.x("DELETE FROM secrets WHERE agent_id = ? AND user_id = ?",
                       (check_id(agent, "agent name"), check_id(user, "user id")))

    def encrypted(self) -> Iterator[tuple[SecretInfo, bytes]]:
        """Every row with its ciphertext (for key rotation)."""
        with self._ts._tx(write=False) as c:
            rows = c.q(f"SELECT {_COLS}, ciphertext FROM secrets ORDER BY agent_id, user_id, name")
        for r in rows:
            yield _info(r), bytes(r[7])

    def reencrypt(self, info: SecretInfo, ciphertext: bytes, key_id: str) -> bool:
        """Swap in a re-encrypted ciphertext if the row is still the version that was read (value unchanged)."""
        with self._ts._tx() as c:
            return c.x("UPDATE secrets SET ciphertext = ?, key_id = ? WHERE agent_id = ? AND user_id = ? AND name = ? "
                       "AND version = ?", (c.blob(ciphertext), key_id, info.agent, info.user or "", info.name,
                                           info.version)) == 1
