"""Host restart and multi-process behaviour with real OS processes: a moorage host process is SIGKILLed with agents
awake, asleep and mid-wake; a new process on the same data recovers every one, with its files intact.
Also: two host processes serving one sleeping agent wake it exactly once between them.

Run as a script (``python test_recovery.py serve``) this file is the host process the tests start and kill.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

ROOT = Path(__file__).resolve().parents[2]
AGENT = "helper"
_HOST_N = itertools.count(1)


# --- the host process ---------------------------------------------------------------------------------------


async def _serve(cfg: dict[str, Any]) -> None:
    from moorage.config import Config
    from moorage.lifecycle.manager import InstanceManager
    from moorage.lifecycle.policies import FixedTimeout
    from moorage.router import Router
    from moorage.sandbox import TemplateRef
    from moorage.store import EntityKey, Scope, open_store
    from tests.lifecycle.test_manager_env import forward
    from tests.sandbox.conftest import DRIVER_FACTORIES

    store = open_store(Config(store_url=cfg["store_url"]))
    principal = store.authenticate(cfg["key"])
    ts = store.tenant(principal)
    driver = DRIVER_FACTORIES[cfg["driver"]](Path(cfg["root"]), Config(data_dir=Path(cfg["data_dir"])))
    manager = InstanceManager(store, driver, host_id=cfg["host"], policy=FixedTimeout(3600), poll_s=0.02)
    report = await manager.start()
    template = TemplateRef(cfg["template"]["id"], cfg["template"]["driver"], Path(cfg["template"]["path"]))

    async def templates(ts: Any, agent: Any) -> TemplateRef:
        return template

    router = Router(store, manager, forward, templates)
    out_lock = asyncio.Lock()

    async def reply(msg: dict[str, Any]) -> None:
        async with out_lock:
            sys.stdout.write(json.dumps(msg) + "\n")
            sys.stdout.flush()

    async def handle(req: dict[str, Any]) -> None:
        try:
            if req["op"] == "route":
                key = EntityKey(AGENT, req["user"], session=req.get("session"))
                result: Any = await router.route(principal, key, req["turn"])
            elif req["op"] == "sleep":
                result = await manager.sleep(ts, Scope.for_user(AGENT, req["user"]))
            else:
                result = manager.stats.__dict__
            await reply({"id": req["id"], "ok": True, "result": result})
        except Exception as e:  # reported to the test, which asserts on it
            await reply({"id": req["id"], "ok": False, "error": f"{type(e).__name__}: {e}"})

    await reply({"ready": True, "report": {k: sorted(v) for k, v in report.__dict__.items()}})
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    tasks = set()
    while line := await reader.readline():
        t = asyncio.create_task(handle(json.loads(line)))
        tasks.add(t)
        t.add_done_callback(tasks.discard)
    await asyncio.gather(*tasks)
    await manager.close()


# --- the tests ----------------------------------------------------------------------------------------------


class Host:
    """A host process the test talks to over stdin/stdout (JSON lines). Its log goes to a file beside the data dir
    (a pipe nobody reads could fill and stall it), and a failed answer carries that log's tail."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + str(ROOT), "MOORAGE_LOG_LEVEL": "info"}
        data = Path(cfg["data_dir"])
        data.parent.mkdir(parents=True, exist_ok=True)
        self.log = data.parent / f"host-{next(_HOST_N)}.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen([sys.executable, __file__, "serve", json.dumps(cfg)], env=env, cwd=ROOT,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        self._next = 0
        hello = self._line()
        assert hello.get("ready"), hello
        self.report: dict[str, list[str]] = hello["report"]

    def _line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=30)
            raise AssertionError(f"host process exited:\n{self.log_tail()}")
        return json.loads(line)

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def send(self, **req: Any) -> int:
        assert self.proc.stdin is not None
        self._next += 1
        self.proc.stdin.write(json.dumps({"id": self._next, **req}) + "\n")
        self.proc.stdin.flush()
        return self._next

    def replies(self, n: int) -> dict[int, dict[str, Any]]:
        out = {}
        for _ in range(n):
            msg = self._line()
            out[msg["id"]] = msg
        return out

    def call(self, **req: Any) -> Any:
        rid = self.send(**req)
        msg = self.replies(1)[rid]
        assert msg["ok"], f"{msg}\nhost log ({self.log}):\n{self.log_tail()}"
        return msg["result"]

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        for f in (self.proc.stdin, self.proc.stdout):
            if f:
                f.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.kill()


def _matrix() -> list[str]:
    from tests.lifecycle.test_manager_env import FULL_MATRIX

    return FULL_MATRIX


@pytest.fixture(params=_matrix())
async def host_cfg(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, Any]]:
    from moorage.config import Config
    from moorage.store import open_store
    from tests.sandbox.conftest import DRIVER_FACTORIES

    driver_name, backend = request.param.split("-")
    store_url = f"sqlite:{tmp_path / 'store'}" if backend == "sqlite" else request.getfixturevalue("pg_url")

    store = open_store(Config(store_url=store_url))
    _, key = store.operator.create_tenant("acme")
    ts = store.tenant(store.authenticate(key.secret))
    ts.agents.create(AGENT, {"lifecycle": {"users": "auto", "concurrency": "parallel"}})
    root, data = tmp_path / "sandboxes", tmp_path / "data"
    factory = DRIVER_FACTORIES[driver_name]
    drv = factory(root, Config(data_dir=data))
    sb = await drv.create("template-src")
    await sb.start()
    await sb.write_file("from-template.txt", b"prepared in the template")
    tpl = await drv.make_template(sb, "tpl-helper")
    await sb.destroy()
    await drv.close()
    cfg = {"store_url": store_url, "key": key.secret, "driver": driver_name, "root": str(root), "data_dir": str(data),
           "host": "host-a", "template": {"id": tpl.id, "driver": tpl.driver, "path": str(tpl.path)}, "_ts": ts}
    yield cfg
    cleaner = factory(root, Config(data_dir=data))
    for sid in await cleaner.list():
        await (await cleaner.open(sid)).destroy()
    await cleaner.close()
    store.close()


def _public(cfg: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in cfg.items() if not k.startswith("_")}


def test_sigkill_with_agents_awake_asleep_and_mid_wake_then_restart_serves_all_with_files(host_cfg: dict[str, Any]) -> None:
    ts = host_cfg["_ts"]
    users = [f"u{i}" for i in range(6)]
    first = Host(_public(host_cfg))
    try:
        for u in users:
            assert first.call(op="route", user=u, turn={"op": "write", "path": "diary.txt", "data": f"{u} was here"}) == "ok"
        for u in users[:4]:
            assert first.call(op="sleep", user=u) is True
        states = {r.scope.user: r.state for r in ts.sandboxes.list()}
        assert states == {"u0": "sleeping", "u1": "sleeping", "u2": "sleeping", "u3": "sleeping",
                          "u4": "running", "u5": "running"}
        # Wakes in flight when the host dies: u2 and u3 are asked for and the process is killed at once.
        first.send(op="route", user="u2", turn={"op": "echo", "text": "never answered"})
        first.send(op="route", user="u3", turn={"op": "echo", "text": "never answered"})
    finally:
        first.kill()
    assert len(ts.sandboxes.list()) == 6

    second = Host(_public(host_cfg))
    try:
        # Recovery moved every instance out of in-between states: nothing is left that nothing will move.
        settled = {r.scope.user: r.state for r in ts.sandboxes.list()}
        assert set(settled.values()) <= {"running", "sleeping"}, settled
        assert not second.report["left"] and not second.report["failed"]
        assert {"u4", "u5"} <= {r.scope.user for r in ts.sandboxes.list() if r.id in
                                second.report["adopted"] + second.report["slept"]}
        ids = {r.scope.user: r.id for r in ts.sandboxes.list()}
        rids = {second.send(op="route", user=u, turn={"op": "read", "path": "diary.txt"}): u for u in users}
        answers = second.replies(len(users))
        for rid, u in rids.items():
            assert answers[rid]["ok"], f"{answers[rid]}\nhost log ({second.log}):\n{second.log_tail()}"
            assert answers[rid]["result"] == f"{u} was here"
        assert second.call(op="stats")["provisions"] == 0  # every agent came back as itself, none was re-made
        assert {r.scope.user: r.id for r in ts.sandboxes.list()} == ids
        assert all(r.state == "running" for r in ts.sandboxes.list())
    finally:
        second.stop()


# Two moorage processes sharing one sandbox root is a process-driver arrangement: a micro-VM's channel takes one
# host connection, so on microvm hosts one process owns the root (docs/lifecycle.md). Across hosts the store's
# compare-and-set claim is what makes the wake single (covered on every driver by the hundred-request tests).
@pytest.mark.parametrize("host_cfg", ["process-sqlite", "process-postgres"], indirect=True)
def test_two_host_processes_wake_one_sleeping_agent_exactly_once(host_cfg: dict[str, Any]) -> None:
    ts = host_cfg["_ts"]
    a = Host(_public(host_cfg))
    b = Host(_public(host_cfg))
    try:
        assert a.call(op="route", user="alice", turn={"op": "write", "path": "f.txt", "data": "shared"}) == "ok"
        assert a.call(op="sleep", user="alice") is True
        wakes_before = ts.usage.totals().get("wakes", 0)
        sent = {}
        for i in range(50):  # both processes get their requests before either answers
            sent[("a", a.send(op="route", user="alice", session=f"a{i}", turn={"op": "echo", "text": f"a{i}"}))] = f"a{i}"
            sent[("b", b.send(op="route", user="alice", session=f"b{i}", turn={"op": "echo", "text": f"b{i}"}))] = f"b{i}"
        got = {("a", k): v for k, v in a.replies(50).items()} | {("b", k): v for k, v in b.replies(50).items()}
        for k, text in sent.items():
            assert got[k]["ok"] and got[k]["result"] == text, got[k]
        assert ts.usage.totals()["wakes"] - wakes_before == 1
        assert len([s for s in ts.spans.recent(limit=10_000) if s.name == "lifecycle.claim_wake"]) == 1
        assert len(ts.sandboxes.list()) == 1
    finally:
        a.stop()
        b.stop()


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        from moorage.log import configure

        configure(os.environ.get("MOORAGE_LOG_LEVEL", "info"))
        asyncio.run(_serve(json.loads(sys.argv[2])))
