"""Check a webhook moorage sent (Standard Webhooks signature, timestamp within five minutes) before trusting it, and
name the delivery (its signed ``webhook-id``, the same on every retry) so a receiver drops duplicates.

Give it the raw body bytes exactly as received: a re-encoded body no longer matches its signature.
"""

from __future__ import annotations

import base64
import secrets
from typing import Any, Mapping

from standardwebhooks.webhooks import Webhook, WebhookVerificationError


class WebhookSignatureError(Exception):
    """The body, id, timestamp or signature of a webhook request does not check out with this secret."""


class WebhookEvent(dict):  # type: ignore[type-arg]
    """The decoded event, a plain dict (``{"type", "timestamp", "data"}``) as before, plus the delivery's ``id``:
    its ``webhook-id``, covered by the signature and the same on every retry of one event, so a receiver that keeps
    the ids it handled drops a retried delivery (``if event.id in seen: return 200``)."""

    def __init__(self, payload: Mapping[str, Any], delivery_id: str) -> None:
        super().__init__(payload)
        self.id = delivery_id


def verify_webhook(secret: str, body: bytes | str, headers: Mapping[str, str]) -> WebhookEvent:
    """The decoded event (``{"type", "timestamp", "data"}``, with the delivery's ``webhook-id`` as ``.id``) if
    ``headers`` sign ``body`` with ``secret`` (the endpoint's ``whsec_...``); raises ``WebhookSignatureError``
    otherwise."""
    lower = {k.lower(): v for k, v in headers.items()}
    try:
        payload = Webhook(secret).verify(body, lower)
    except (WebhookVerificationError, ValueError) as e:
        raise WebhookSignatureError(str(e)) from e
    if not isinstance(payload, dict):
        raise WebhookSignatureError("the signed body is not a moorage event (a JSON object with type and data)")
    return WebhookEvent(payload, lower["webhook-id"])


def new_webhook_secret() -> str:
    """A fresh signing secret in the form ``create_webhook(secret=...)`` takes (``whsec_`` + base64 of 32 random
    bytes). Keep it before subscribing: a backend that restarts verifies with it again without a new webhook."""
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
