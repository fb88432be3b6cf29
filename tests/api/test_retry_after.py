"""Every 429 and 503 the API sends carries a ``Retry-After`` header: walked over the error types that map to
those statuses, over every route of a server without a runtime (503), and over a real overload (429)."""

from __future__ import annotations

import asyncio
import importlib
import io
import math
import pkgutil
import tarfile
import textwrap
from pathlib import Path
from typing import Any

import httpx

import moorage
from moorage.api.problem import DEFAULT_RETRY_AFTER_S, from_error
from moorage.errors import MoorageError
from moorage.store import Store
from tests.api.conftest import aclient
from tests.api.test_cross_tenant import _PARAM, app_routes, body_for, send

SLOW_AGENT = '''
import asyncio

async def on_message(ctx, message):
    if message == "slow":
        await asyncio.sleep(6)
    return "ok: " + message
'''


def fill(path: str, ids: dict[str, Any]) -> str:
    """The path with its parameters filled from ``ids`` (a parameter a newer route adds gets a placeholder)."""
    return _PARAM.sub(lambda m: str(ids.get(m.group(1), f"no-{m.group(1)}")), path)


def archive(tmp_path: Path, name: str, body: str, lifecycle: str = "") -> bytes:
    root = tmp_path / f"src-{name}"
    root.mkdir(parents=True, exist_ok=True)
    (root / "moorage.toml").write_text(f'[agent]\nname = "{name}"\nentry = "agent.py"\n'
                                       f'[agent.lifecycle]\nusers = "auto"\n{lifecycle}')
    (root / "agent.py").write_text(textwrap.dedent(body))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for p in sorted(root.iterdir()):
            tar.add(p, arcname=p.name)
    return buf.getvalue()


def _all_error_types() -> list[type[MoorageError]]:
    for mod in pkgutil.walk_packages(moorage.__path__, "moorage."):
        if ".guest" in mod.name or mod.name.endswith("__main__"):
            continue  # guest code runs inside the sandbox; __main__ modules run on import
        try:
            importlib.import_module(mod.name)
        except Exception:  # noqa: BLE001 - optional extras; an unimportable module cannot raise anything here
            continue
    seen: list[type[MoorageError]] = []
    todo = [MoorageError]
    while todo:
        cls = todo.pop()
        seen.append(cls)
        todo.extend(cls.__subclasses__())
    return seen


def test_every_429_and_503_error_type_maps_to_a_retry_after_header():
    walked = 0
    for cls in _all_error_types():
        if getattr(cls, "http_status", None) not in (429, 503):
            continue
        # Built without its own __init__ (signatures differ): a bare instance must still get a header.
        err = cls.__new__(cls)
        MoorageError.__init__(err, f"{cls.__name__} for the test", hint="retry")
        r = from_error(err, "trace")
        # Its class's own wait (StoreUnreachable: PostgreSQL back in a moment), else its status's default.
        own = next((v for v in (getattr(cls, a, None) for a in ("retry_after", "retry_after_s", "resets_in"))
                    if isinstance(v, (int, float)) and not isinstance(v, bool)), None)
        expected = math.ceil(own) if own is not None else DEFAULT_RETRY_AFTER_S[cls.http_status]
        assert r.headers.get("retry-after") == str(expected), cls
        for attr in ("retry_after", "retry_after_s", "resets_in"):
            setattr(err, attr, 2.2)
            assert from_error(err, "t").headers["retry-after"] == str(math.ceil(2.2)), (cls, attr)
            delattr(err, attr)
            if getattr(cls, attr, None) is not None:
                break  # the class's own value of this one is trusted before the attributes after it
        walked += 1
    # Overloaded (router), RateLimited and BudgetExceeded (LLM), UnavailableError and its subclasses at least.
    assert walked >= 5


async def test_every_503_route_of_a_server_without_runtime_has_retry_after(live, acme: str):
    seen_503 = 0
    async with httpx.AsyncClient(base_url=live.url, timeout=60, headers={"Authorization": f"Bearer {acme}"}) as c:
        ids = {"agent": "a", "user": "u", "run_id": "r", "sandbox_id": "s", "trace_id": "t", "key_id": "k",
               "execution_id": "e", "webhook_id": "w", "delivery_id": "d"}
        for method, path in app_routes(live.app):
            kw = body_for(method, path, {**ids, "agent": "a", "user": "u"})
            r = await send(c, method, fill(path, ids), **kw)
            if r.status_code in (429, 503):
                seen_503 += r.status_code == 503
                assert r.headers.get("retry-after", "").isdigit(), f"{method} {path}: {r.status_code} without Retry-After"
                assert r.json()["retry_after"] >= 1
    assert seen_503 >= 1  # turns need a runtime: the invoke routes answer 503 here


async def test_overloaded_turns_are_429_with_retry_after(live_rt, acme: str, store: Store, tmp_path: Path):
    async with aclient(live_rt, acme) as c:
        r = await c.post("/v1/agents/slow/deployments", content=archive(tmp_path, "slow", SLOW_AGENT, "max_queue = 1\n"),
                         headers={"content-type": "application/gzip"})
        assert r.status_code == 201, r.text
        first = asyncio.create_task(c.post("/v1/agents/slow/invoke", json={"message": "slow", "user": "ann",
                                                                           "session": "s0"}))
        ts = store.tenant(store.authenticate(acme))
        while not any(run.status == "running" for run in ts.runs.list(limit=100)):
            await asyncio.sleep(0.05)
        # Other sessions of the same instance: one may wait (max_queue = 1), the rest are refused at once.
        rest = await asyncio.gather(*[c.post("/v1/agents/slow/invoke", json={"message": f"m{i}", "user": "ann",
                                                                             "session": f"s{i + 1}"}) for i in range(6)])
        assert (await first).json()["reply"] == "ok: slow"
    refused = [r for r in rest if r.status_code == 429]
    assert len(refused) >= 4, [r.status_code for r in rest]
    for r in refused:
        assert r.headers["retry-after"] == "1"
        assert r.json()["type"].endswith("/overloaded") and r.json()["retry_after"] == 1
    assert all(r.status_code in (200, 429) for r in rest)
