"""Webhooks of an agent: create (the ``whsec_`` secret is shown once), list, get, delete; their deliveries with
every attempt, and replay of a delivery by id.

Deliveries are sent by the host's delivery loop (``moorage.webhooks``), signed in the Standard Webhooks format.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any
from urllib.parse import urlsplit

from moorage.api import schemas as S
from moorage.api.pagination import decode_cursor, encode_cursor, parse_limit
from moorage.api.routes._common import CURSOR, LIMIT, agent_of
from moorage.api.routing import Call, Endpoint, Reply
from moorage.errors import InvalidInput, NotFound
from moorage.store.webhooks import WEBHOOK_EVENTS, Delivery, Webhook


def hook_json(h: Webhook, *, secret: bool = False) -> dict[str, Any]:
    return {"id": h.id, "agent": h.agent, "url": h.url, "events": list(h.events), "enabled": h.enabled,
            "created_at": h.created_at, "secret": h.secret if secret else None}


def delivery_json(d: Delivery, attempts: list[Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"id": d.id, "webhook_id": d.webhook_id, "event": d.event, "status": d.status,
                           "attempts": d.attempts, "next_attempt_at": d.next_at, "created_at": d.created_at,
                           "updated_at": d.updated_at, "payload": d.payload}
    if attempts is not None:
        out["attempt_log"] = [{"seq": a.seq, "at": a.at, "status_code": a.status_code, "error": a.error,
                               "duration_ms": a.duration_ms} for a in attempts]
    return out


def _hook(call: Call) -> Webhook:
    agent = agent_of(call)
    hook = call.tenant.webhooks.get(call.path["webhook_id"])
    if hook.agent != agent.name:  # another agent's webhook is not found under this one
        raise NotFound(f"no webhook {call.path['webhook_id']!r} on agent {agent.name!r}")
    return hook


def _delivery(call: Call) -> Delivery:
    hook = _hook(call)
    d = call.tenant.deliveries.get(call.path["delivery_id"])
    if d.webhook_id != hook.id:
        raise NotFound(f"no delivery {call.path['delivery_id']!r} of webhook {hook.id!r}")
    return d


#: A signing secret's key, in bytes, as Standard Webhooks asks (``whsec_`` + base64 of them).
SECRET_BYTES = (24, 64)


def check_secret(secret: str | None) -> None:
    """Refuse a secret no delivery could be signed with (422) rather than accept it and never send one."""
    if secret is None or not secret.startswith("whsec_"):
        return  # none: one is generated; a wrong prefix is the store's refusal
    b64 = secret[len("whsec_"):]
    try:
        key = base64.b64decode(b64 + "=" * (-len(b64) % 4), validate=True)
    except (ValueError, binascii.Error):
        key = b""
    if not SECRET_BYTES[0] <= len(key) <= SECRET_BYTES[1]:
        raise InvalidInput(f"a webhook secret is whsec_ and the base64 of {SECRET_BYTES[0]} to {SECRET_BYTES[1]} "
                           f"bytes; this one decodes to {len(key)} usable bytes",
                           hint="omit it to have one generated")


def check_target(url: str) -> None:
    """Refuse a URL no delivery could reach (no host, a malformed address or port) at once, with why."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise InvalidInput(f"webhook url {url!r} is malformed: {e}", hint="e.g. https://example.com/hooks/moorage") from None
    if parts.scheme in ("http", "https") and not parts.hostname:
        raise InvalidInput(f"webhook url {url!r} names no host", hint="e.g. https://example.com/hooks/moorage")
    if port == 0:
        raise InvalidInput(f"webhook url {url!r} has port 0", hint="e.g. https://example.com/hooks/moorage")


def create_webhook(call: Call) -> Reply:
    agent = agent_of(call)
    events = call.field("events", list, required=False)
    url, secret = call.field("url", str), call.field("secret", str, required=False)
    check_target(url)
    check_secret(secret)
    hook = call.tenant.webhooks.create(agent.name, url, events, secret)
    return Reply(hook_json(hook, secret=True), 201, {"Location": f"/v1/agents/{agent.name}/webhooks/{hook.id}"})


def list_webhooks(call: Call) -> dict[str, Any]:
    agent = agent_of(call)
    return {"data": [hook_json(h) for h in call.tenant.webhooks.list(agent.name)], "next_cursor": None}


def get_webhook(call: Call) -> dict[str, Any]:
    return hook_json(_hook(call))


def delete_webhook(call: Call) -> dict[str, Any]:
    hook = _hook(call)
    call.tenant.webhooks.delete(hook.id)
    return {"deleted": hook.id}


def list_deliveries(call: Call) -> dict[str, Any]:
    hook = _hook(call)
    limit = parse_limit(call.query("limit"))
    cursor = decode_cursor(call.query("cursor"))
    before, before_id = cursor.get("before"), cursor.get("id")
    if (before is not None and not isinstance(before, (int, float))) or \
            (before_id is not None and (before is None or not isinstance(before_id, str))):
        raise InvalidInput("malformed cursor", hint="pass the next_cursor of the previous page unchanged")
    rows = call.tenant.deliveries.list(hook.id, limit=limit + 1, before=before, before_id=before_id)
    page = rows[:limit]
    # The last one's time and id: deliveries made in the same instant (one event, several webhooks' worth; a
    # burst) are told apart by id, so none falls between two pages.
    last = {"before": page[-1].created_at, "id": page[-1].id} if len(rows) > limit else None
    return {"data": [delivery_json(d) for d in page], "next_cursor": encode_cursor(last) if last else None}


def get_delivery(call: Call) -> dict[str, Any]:
    d = _delivery(call)
    return delivery_json(d, call.tenant.deliveries.attempts(d.id))


def replay_delivery(call: Call) -> Reply:
    d = _delivery(call)
    return Reply(delivery_json(call.tenant.deliveries.replay(d.id)), 202)


_HOOKS = "/v1/agents/{agent}/webhooks"
_HOOK = _HOOKS + "/{webhook_id}"
WEBHOOK = S.obj({"id": S.STR, "agent": S.STR, "url": S.STR, "events": {"type": "array", "items": S.STR},
                 "enabled": {"type": "boolean"}, "created_at": S.NUM, "secret": S.NSTR})
DELIVERY = S.obj({"id": S.STR, "webhook_id": S.STR, "event": S.STR,
                  "status": {"enum": ["pending", "delivered", "failed"]}, "attempts": S.INT,
                  "next_attempt_at": {"type": ["number", "null"]}, "created_at": S.NUM, "updated_at": S.NUM,
                  # What is sent: the event, when it happened, and its data (the event's own fields).
                  "payload": S.obj({"type": S.STR, "timestamp": S.NUM, "data": S.OBJ}),
                  "attempt_log": {"type": "array", "items": S.obj({"seq": S.INT, "at": S.NUM,
                                                                   "status_code": {"type": ["integer", "null"]},
                                                                   "error": S.NSTR, "duration_ms": S.NUM})}},
                 # attempt_log: with one delivery (GET .../deliveries/{id}), not in a listing or a replay's answer.
                 ["id", "webhook_id", "event", "status", "attempts", "next_attempt_at", "created_at", "updated_at",
                  "payload"])


def _page(item: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {"data": {"type": "array", "items": item}, "next_cursor": S.NSTR}}


ENDPOINTS = [
    Endpoint("POST", _HOOKS, create_webhook, "Create a webhook (its whsec_ secret is returned once)", "webhooks",
             "createWebhook", scope="deploy", status=201, secret_fields=("secret",),
             body=S.obj({"url": {"type": "string", "minLength": 1},
                         "events": {"type": "array", "items": {"enum": list(WEBHOOK_EVENTS)}, "minItems": 1},
                         "secret": S.STR}, ["url"]),
             response=WEBHOOK),
    Endpoint("GET", _HOOKS, list_webhooks, "List the agent's webhooks", "webhooks", "listWebhooks", scope="read",
             response=_page(WEBHOOK)),
    Endpoint("GET", _HOOK, get_webhook, "Get a webhook", "webhooks", "getWebhook", scope="read", response=WEBHOOK),
    Endpoint("DELETE", _HOOK, delete_webhook, "Delete a webhook", "webhooks", "deleteWebhook", scope="deploy",
             response=S.obj({"deleted": S.STR})),
    Endpoint("GET", _HOOK + "/deliveries", list_deliveries, "List a webhook's deliveries, newest first", "webhooks",
             "listWebhookDeliveries", scope="read", query=(LIMIT, CURSOR), response=_page(DELIVERY)),
    Endpoint("GET", _HOOK + "/deliveries/{delivery_id}", get_delivery, "Get a delivery with every attempt",
             "webhooks", "getWebhookDelivery", scope="read", response=DELIVERY),
    Endpoint("POST", _HOOK + "/deliveries/{delivery_id}/replay", replay_delivery, "Send a delivery again now",
             "webhooks", "replayWebhookDelivery", scope="deploy", status=202, response=DELIVERY),
]
