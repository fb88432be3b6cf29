"""Share-link tokens: ``tenant.link.expiry.key.mac``, signed with a key derived from the operator's secrets key.

The signature lets a host refuse a forged or altered token before touching any store; the link's row
(``store/share_links.py``) is what makes a token revocable. Every refusal is the same ``NotFound``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import time
from dataclasses import dataclass
from typing import Any

from moorage.errors import NotFound
from moorage.store import Principal, Store, TenantStore
from moorage.store.share_links import ShareLink

_TOKEN = re.compile(r"^([0-9a-zA-Z_-]{1,64})\.([0-9a-f]{32})\.([0-9]{1,12})\.([0-9a-zA-Z]{8})\.([0-9A-Za-z_-]{43})$")
_CONTEXT = b"moorage share links v1"


class ShareLinkNotFound(NotFound):
    """A share link that is unknown, altered, expired or revoked: all look the same from outside."""

    code = "share-link-not-found"


def _mac_key(secret: bytes) -> bytes:
    return hmac.new(secret, _CONTEXT, hashlib.sha256).digest()


@dataclass(frozen=True)
class ShareSigner:
    """Signs and checks tokens with the operator's secrets keys (the first signs; all are accepted)."""

    keys: tuple[tuple[str, bytes], ...]

    @classmethod
    def from_config(cls, config: Any) -> "ShareSigner":
        from moorage.secrets import Keyring

        return cls(tuple((kid, _mac_key(key)) for kid, key in Keyring.from_config(config).keys))

    @staticmethod
    def _mac(key: bytes, tenant_id: str, link_id: str, expires: int) -> str:
        msg = f"{tenant_id}.{link_id}.{expires}".encode()
        return base64.urlsafe_b64encode(hmac.new(key, msg, hashlib.sha256).digest()).decode().rstrip("=")

    def token(self, tenant_id: str, link: ShareLink) -> str:
        kid, key = self.keys[0]
        expires = int(link.expires_at)
        return f"{tenant_id}.{link.id}.{expires}.{kid}.{self._mac(key, tenant_id, link.id, expires)}"

    def open(self, store: Store, token: str, now: float | None = None) -> tuple[TenantStore, ShareLink]:
        """The tenant and the live link a token names, or ``ShareLinkNotFound`` (forged, altered, expired,
        revoked or unknown alike)."""
        now = time.time() if now is None else now
        gone = ShareLinkNotFound("no such share link, or it expired or was revoked",
                                 hint="ask the app's owner for a new link")
        m = _TOKEN.fullmatch(token or "")
        if m is None:
            raise gone
        tenant_id, link_id, expires, kid, mac = m.group(1), m.group(2), int(m.group(3)), m.group(4), m.group(5)
        key = next((k for i, k in self.keys if i == kid), None)
        if key is None or not hmac.compare_digest(mac, self._mac(key, tenant_id, link_id, expires)) or now >= expires:
            raise gone
        try:
            store.operator.principal(tenant_id)
        except NotFound:
            raise gone from None
        except Exception:
            raise gone from None
        ts = store.tenant(Principal(tenant_id, frozenset({"invoke"}), key_id=f"share:{link_id}"))
        try:
            link = ts.share_links.get(link_id)
        except NotFound:
            raise gone from None
        if not link.usable(now) or int(link.expires_at) != expires:
            raise gone
        # The link's own principal: one user of one agent, like an end-user token.
        return store.tenant(Principal(tenant_id, frozenset({"invoke"}), key_id=f"share:{link_id}",
                                      agent=link.agent, user=link.user)), link


def signer_of(rt: Any) -> ShareSigner:
    """The runtime's share-link signer (``rt.share_signer``), made from the operator's keys on first use."""
    signer = getattr(rt, "share_signer", None)
    if signer is None:
        signer = rt.share_signer = ShareSigner.from_config(rt.config)
    return signer
