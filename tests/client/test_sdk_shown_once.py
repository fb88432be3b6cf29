"""A create whose answer carries a secret shown once (a webhook's secret, an API key, an end-user token, a share
link's token) and was lost on the way (the connection broke after the server made it) is retried with the same
Idempotency-Key, and the server's replay has that secret as null. The SDK says so (``Conflict``,
``secret-not-shown``, what to do) instead of handing back a record whose secret is None, which a backend would
store and then fail every signature check with."""

from __future__ import annotations

import httpx
import pytest

from moorage import AsyncClient, Client
from moorage.client import Conflict


def lossy(answer: dict, field: str):
    """The first attempt's answer is lost; the retry (same key) gets the replay, without the secret."""
    keys: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        keys.append(request.headers["idempotency-key"])
        if len(keys) == 1:
            raise httpx.ReadError("connection reset after the request was sent", request=request)
        return httpx.Response(201, json={**answer, field: None}, headers={"idempotent-replayed": "true"})

    return handler, keys


CASES = [
    (lambda sdk: sdk.create_webhook("bot", "https://example.com/h"), {"id": "wh_1", "url": "https://example.com/h"},
     "secret", "delete webhook wh_1"),
    (lambda sdk: sdk.create_key(["read"]), {"id": "k1", "scopes": ["read"]}, "secret", "revoke key k1"),
    (lambda sdk: sdk.issue_user_token("bot", "ann"), {"agent": "bot", "user": "ann", "expires_at": 1.0}, "token",
     "issue another token"),
    (lambda sdk: sdk.create_share_link("bot", "ann"), {"id": "sl_1", "agent": "bot", "user": "ann"}, "token",
     "revoke share link sl_1"),
]


@pytest.mark.parametrize("call, answer, field, hint", CASES, ids=["webhook", "key", "token", "share-link"])
def test_a_lost_one_time_secret_is_an_error_not_a_none(call, answer, field, hint) -> None:
    handler, keys = lossy(answer, field)
    with Client("http://moorage.test", "mrg_x", transport=httpx.MockTransport(handler), sleep=lambda s: None) as sdk:
        with pytest.raises(Conflict) as e:
            call(sdk)
    assert e.value.code == "secret-not-shown" and hint in (e.value.hint or "") and field in e.value.detail
    assert len(keys) == 2 and keys[0] == keys[1]  # the same request, retried: nothing was made twice


async def test_the_async_client_says_so_too() -> None:
    handler, _ = lossy({"id": "wh_1"}, "secret")

    async def sleep(_s: float) -> None:
        return None

    async with AsyncClient("http://moorage.test", "mrg_x", transport=httpx.MockTransport(handler), sleep=sleep) as sdk:
        with pytest.raises(Conflict) as e:
            await sdk.create_webhook("bot", "https://example.com/h")
    assert e.value.code == "secret-not-shown"


def test_a_secret_shown_is_returned() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(201, json={"id": "wh_1", "secret": "whsec_x"})

    with Client("http://moorage.test", "mrg_x", transport=httpx.MockTransport(handler)) as sdk:
        assert sdk.create_webhook("bot", "https://example.com/h")["secret"] == "whsec_x"
