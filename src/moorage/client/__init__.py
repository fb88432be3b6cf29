"""The Python SDK for a moorage server: ``Client`` (blocking) and ``AsyncClient`` (asyncio), typed methods for
the public routes, page iterators, retries with idempotency keys that honour ``Retry-After``, streaming turns,
waiting on executions, and ``verify_webhook`` for receivers. See docs/sdk.md.

It speaks HTTP only; nothing here imports the host's internals.
"""

from moorage.client.aio import AsyncClient
from moorage.client.errors import (ApiError, AuthError, BadRequest, Conflict, DiskFull, InvalidArgument, NotFound,
                                   PoolExhausted, RateLimited, ServerError, Unavailable)
from moorage.client.sync import Client
from moorage.client.webhooks import WebhookEvent, WebhookSignatureError, new_webhook_secret, verify_webhook

__all__ = ["ApiError", "AsyncClient", "AuthError", "BadRequest", "Client", "Conflict", "DiskFull", "InvalidArgument", "NotFound",
           "PoolExhausted", "RateLimited", "ServerError", "Unavailable", "WebhookEvent", "WebhookSignatureError", "new_webhook_secret", "verify_webhook"]
