"""Check a webhook moorage sent (Standard Webhooks signature, timestamp within five minutes) before trusting it.

Give it the raw body bytes exactly as received: a re-encoded body no longer matches its signature.
"""

from __future__ import annotations

import base64
import secrets
from typing import Any, Mapping

from standardwebhooks.webhooks import Webhook, WebhookVerificationError


class WebhookSignatureError(Exception):
    """The body, id, timestamp or signature of a webhook request does not check out with this secret."""


def verify_webhook(secret: str, body: bytes | str, headers: Mapping[str, str]) -> Any:
    """The decoded event (``{"type", "timestamp", "data"}``) if ``headers`` sign ``body`` with ``secret``
    (the endpoint's ``whsec_...``); raises ``WebhookSignatureError`` otherwise."""
    try:
        return Webhook(secret).verify(body, {k.lower(): v for k, v in headers.items()})
    except (WebhookVerificationError, ValueError) as e:
        raise WebhookSignatureError(str(e)) from e


def new_webhook_secret() -> str:
    """A fresh signing secret in the form ``create_webhook(secret=...)`` takes (``whsec_`` + base64 of 32 random
    bytes). Keep it before subscribing: a backend that restarts verifies with it again without a new webhook."""
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
