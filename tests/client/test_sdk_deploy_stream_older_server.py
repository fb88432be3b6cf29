"""``deploy_stream`` against a server from before deploys streamed: it answers the deploy as it always did (201 and the
deployment as JSON, whatever the ``Accept`` header), and both clients give that as the one ``deployment`` event
rather than ending with none (``moorage deploy`` then said the stream ended without a result, the deploy live)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from moorage.client import AsyncClient, Client
from tests.api.conftest import agent_archive, serve

DEPLOYMENT = {"id": "d1", "agent_id": "a1", "number": 7, "status": "ready"}


async def _deploy(request: Request) -> JSONResponse:
    assert (await request.body())[:2] == b"\x1f\x8b"
    return JSONResponse(DEPLOYMENT, status_code=201)


@pytest.fixture
def older() -> Iterator[str]:
    server, thread, url = serve(Starlette(routes=[Route("/v1/agents/{agent}/deployments", _deploy, methods=["POST"])]))
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_the_sync_client_gives_an_older_servers_answer_as_the_deployment(older: str, tmp_path: Path) -> None:
    with Client(older, "mrg_x") as sdk:
        assert list(sdk.deploy_stream("echo", agent_archive(tmp_path))) == [{"event": "deployment", "data": DEPLOYMENT}]


async def test_the_async_client_gives_an_older_servers_answer_as_the_deployment(older: str, tmp_path: Path) -> None:
    async with AsyncClient(older, "mrg_x") as sdk:
        events = [ev async for ev in sdk.deploy_stream("echo", agent_archive(tmp_path))]
    assert events == [{"event": "deployment", "data": DEPLOYMENT}]
