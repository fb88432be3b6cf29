"""``paginate`` walks every list method the docs name, the paged ones (a cursor per page) and those answered in one
page with no cursor parameter at all (webhooks, secrets, share links); sync and async alike."""

from __future__ import annotations

import json

import httpx

from moorage import AsyncClient, Client


def handler(request: httpx.Request) -> httpx.Response:
    path, cursor = request.url.path, request.url.params.get("cursor")
    if path == "/v1/agents/bot/users":
        page = {None: {"data": [{"id": "a"}], "next_cursor": "c1"}, "c1": {"data": [{"id": "b"}], "next_cursor": None}}
        return httpx.Response(200, json=page[cursor])
    assert cursor is None, path  # one-page lists are never sent a cursor
    return httpx.Response(200, content=json.dumps({"data": [{"id": path.rsplit("/", 1)[-1]}], "next_cursor": None}),
                          headers={"content-type": "application/json"})


def test_paginate_walks_paged_and_one_page_lists() -> None:
    with Client("http://moorage.test", "mrg_x", transport=httpx.MockTransport(handler)) as sdk:
        assert [u["id"] for u in sdk.paginate(sdk.list_users, "bot")] == ["a", "b"]
        assert [h["id"] for h in sdk.paginate(sdk.list_webhooks, "bot")] == ["webhooks"]
        assert [s["id"] for s in sdk.paginate(sdk.list_secrets, "bot", user="u")] == ["secrets"]
        assert [s["id"] for s in sdk.paginate(sdk.list_share_links, "bot", "u")] == ["share-links"]


async def test_async_paginate_walks_paged_and_one_page_lists() -> None:
    async with AsyncClient("http://moorage.test", "mrg_x", transport=httpx.MockTransport(handler)) as sdk:
        assert [u["id"] async for u in sdk.paginate(sdk.list_users, "bot")] == ["a", "b"]
        assert [h["id"] async for h in sdk.paginate(sdk.list_webhooks, "bot")] == ["webhooks"]
        assert [s["id"] async for s in sdk.paginate(sdk.list_secrets, "bot")] == ["secrets"]
