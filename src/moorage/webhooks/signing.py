"""Signatures in the Standard Webhooks format: ``webhook-id``, ``webhook-timestamp`` and ``webhook-signature``
(``v1,`` + base64 of HMAC-SHA256 over ``id.timestamp.body``, keyed by the ``whsec_`` secret's bytes).

Signing and verifying are done by the ``standardwebhooks`` package, the format's reference implementation.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Mapping

from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from moorage.errors import MoorageError


class InvalidSignature(MoorageError):
    """A webhook request whose signature, id or timestamp does not check out."""

    code = "invalid-signature"
    http_status = 401


def sign(secret: str, msg_id: str, timestamp: int, body: str) -> dict[str, str]:
    """The three headers that go with ``body`` (the exact bytes sent, as text)."""
    when = datetime.fromtimestamp(timestamp, tz=timezone.utc)
    return {"webhook-id": msg_id, "webhook-timestamp": str(int(timestamp)),
            "webhook-signature": Webhook(secret).sign(msg_id, when, body)}


def verify(secret: str, body: bytes | str, headers: Mapping[str, str]) -> Any:
    """Check a received webhook and return its decoded JSON payload; raises ``InvalidSignature``.

    The timestamp must be within five minutes of now, so an old message replayed later is refused."""
    try:
        return Webhook(secret).verify(body, {k.lower(): v for k, v in headers.items()})
    except (WebhookVerificationError, ValueError) as e:  # ValueError: a malformed header or base64
        raise InvalidSignature(f"webhook signature does not verify: {e}",
                               hint="check the endpoint's whsec_ secret and that the body was not re-encoded") from e
