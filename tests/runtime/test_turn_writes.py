"""A turn's durable writes: two commits of its own (one on the reply path), its messages embedded after the reply.

The commits are counted on the real SQLite backend: every write transaction that changed the database (its
connection's ``total_changes`` moved), i.e. every commit that appends to the WAL and fsyncs it. The must-show
test kills a real ``moorage up`` host after it sent a reply but before that turn's embedding ran, starts a new
host on the same data dir and finds the message by meaning.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import numpy as np
import pytest

import moorage.store.sqlite as sqlite_backend
from moorage.cli.up import tar_dir
from moorage.config import Config
from moorage.durable import DurableEngine
from moorage.memory import default_embedder
from moorage.memory.embed_queue import THREAD_NAME
from moorage.memory.embeddings import from_bytes
from moorage.store import EntityKey, Scope, open_store
from tests.lifecycle.crash_up import stop_sandboxes
from tests.runtime.conftest import Env, write_agent
from tests.upproc import wait_serving

ROOT = Path(__file__).resolve().parents[2]

#: What the design allows: the turn's own commits (before the agent runs, after it answered) and, of those,
#: the ones between the agent's answer and the reply.
TURN_COMMITS = 2
REPLY_PATH_COMMITS = 1
#: The turn's own commits are counted: the automatic checkpoint after the reply (time travel, on by default; its
#: commit comes after the reply, off the reply path: tests/timetravel/test_auto.py) is turned off here.
OWN_COMMITS_ONLY = "[agent.timetravel]\nauto = false\n"

# Waits at "wait" for the test's go-ahead (a file on its disk), so the test can mark the moment the agent is
# running: commits before the mark are the turn's start, commits after it are the reply path.
AGENT = """
import asyncio, os

async def on_message(ctx, message):
    await ctx.memory.context(message, system="Be brief.")
    if message.startswith("step"):
        await ctx.step("charge", lambda: {"charged": 42})
    await ctx.emit("waiting", {})
    while not os.path.exists("/work/go"):
        await asyncio.sleep(0.01)
    os.remove("/work/go")
    return "noted: " + message
"""


class Commits:
    """Every commit on the SQLite backend that changed a database, with the thread that made it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.log: list[str] = []  # committing thread's name, in commit order

    def __len__(self) -> int:
        return len(self.log)

    def turn(self, since: int = 0, until: int | None = None) -> int:
        """Commits in log[since:until] made by anything but the background embedding thread."""
        with self.lock:
            return sum(1 for name in self.log[since:until] if name != THREAD_NAME)

    def embedding(self) -> int:
        with self.lock:
            return sum(1 for name in self.log if name == THREAD_NAME)


@pytest.fixture
def commits(monkeypatch: pytest.MonkeyPatch) -> Commits:
    seen = Commits()
    original = sqlite_backend._transaction

    @contextlib.contextmanager
    def counted(conn: Any, write: bool) -> Iterator[Any]:
        before = conn.total_changes
        with original(conn, write) as c:
            yield c
        if conn.total_changes != before:
            with seen.lock:
                seen.log.append(threading.current_thread().name)

    monkeypatch.setattr(sqlite_backend, "_transaction", counted)
    return seen


def _go(env: Env) -> None:
    (work,) = list(env.cfg.sandboxes_dir.glob("*/layer/work"))
    (work / "go").write_text("")


async def _turn(env: Env, commits: Commits, message: str) -> tuple[Any, int, int, int]:
    """One turn through ``Runtime.stream``: (result, commits before the mark, after it, in all)."""
    k = EntityKey("notes", "ada", "s1")
    start = len(commits)
    mark = None
    result = None
    async for ev in env.runtime.stream(env.principal, k, message):
        if ev.kind == "event" and mark is None:
            mark = len(commits)
            await asyncio.to_thread(_go, env)
        elif ev.kind == "done":
            result = ev.data
    assert mark is not None and result is not None
    end = len(commits)
    return result, commits.turn(start, mark), commits.turn(mark, end), commits.turn(start, end)


async def test_an_awake_turn_commits_twice_and_once_on_the_reply_path(env: Env, commits: Commits, tmp_path: Path) -> None:
    await env.runtime.deploy(env.principal, write_agent(tmp_path / "notes", "notes", AGENT, extra_manifest=OWN_COMMITS_ONLY))
    await _turn(env, commits, "hello")  # provisions the instance and opens the session
    await asyncio.to_thread(env.runtime.embed_queue.wait_idle, 60)

    result, before, reply_path, total = await _turn(env, commits, "I keep the spare key under the blue pot.")
    assert result.reply == "noted: I keep the spare key under the blue pot."
    assert (before, reply_path, total) == (TURN_COMMITS - REPLY_PATH_COMMITS, REPLY_PATH_COMMITS, TURN_COMMITS)

    # All of it is in the store: the run's result, both messages, working memory with both, the turn's spans.
    ts = env.store.tenant(env.principal)
    run = ts.runs.get(result.run_id)
    assert run.status == "succeeded" and run.result["reply"] == result.reply
    scope = Scope.session("notes", "ada", "s1")
    events = ts.events.list(scope, limit=100)
    assert [(e.speaker, e.content) for e in events[-2:]] == [
        ("user", "I keep the spare key under the blue pot."), ("assistant", result.reply)]
    wm = str(ts.state.get(scope, "working_memory").value)
    assert "spare key under the blue pot" in wm and result.reply in wm
    names = [s.name for s in ts.spans.trace(result.trace_id)]
    assert "turn" in names and "memory.context" in names

    # The messages are embedded after the reply, by the background thread, in commits of its own.
    assert await asyncio.to_thread(env.runtime.embed_queue.wait_idle, 60)
    assert ts.events.unembedded() == []
    assert commits.embedding() >= 1
    vectors = dict(ts.events.embeddings(scope, ids=[e.id for e in events[-2:]]))
    assert len(vectors) == 2
    found = env.runtime.memory(ts).episodic.search(scope, "where is the house key hidden?", k=1)
    assert found[0].event.id == events[-2].id and found[0].dense_rank is not None


async def test_a_step_commits_when_it_happens(env: Env, commits: Commits, tmp_path: Path) -> None:
    await env.runtime.deploy(env.principal, write_agent(tmp_path / "notes", "notes", AGENT, extra_manifest=OWN_COMMITS_ONLY))
    await _turn(env, commits, "hello")
    ts = env.store.tenant(env.principal)
    k = EntityKey("notes", "ada", "s1")
    start = len(commits)
    result = None
    async for ev in env.runtime.stream(env.principal, k, "step please"):
        if ev.kind == "event":
            # The agent is still running: its step is already journaled (committed), not held for the end.
            (run,) = [r for r in ts.runs.list(status=["running"], limit=10) if r.name == "turn"]
            steps = [h for h in DurableEngine(ts).history(run.id) if h.kind == "step"]
            assert [(h.name, h.status, h.result) for h in steps] == [("charge", "succeeded", {"charged": 42})]
            mark = len(commits)
            await asyncio.to_thread(_go, env)
        elif ev.kind == "done":
            result = ev.data
    assert result is not None and result.reply == "noted: step please"
    assert commits.turn(mark, len(commits)) == REPLY_PATH_COMMITS
    assert commits.turn(start, len(commits)) == TURN_COMMITS + 1  # + the step


COUNTER = """
import os

async def on_message(ctx, message):
    n = int(open("/work/n").read()) + 1 if os.path.exists("/work/n") else 1
    with open("/work/n", "w") as f:
        f.write(str(n))
    return "run %d: %s" % (n, message)
"""


async def test_two_requests_with_one_idempotency_key_run_the_turn_once(env: Env, tmp_path: Path) -> None:
    # The run is created by the turn's first commit: requests that both found no run meet there, and the
    # second one answers with the first one's result.
    await env.runtime.deploy(env.principal, write_agent(tmp_path / "counter", "counter", COUNTER))
    k = EntityKey("counter", "ada", "s1")
    a, b = await asyncio.gather(*(env.runtime.invoke(env.principal, k, "hi", idempotency_key="req-1") for _ in range(2)))
    assert a.reply == b.reply == "run 1: hi" and a.run_id == b.run_id
    ts = env.store.tenant(env.principal)
    assert [r.id for r in ts.runs.list(limit=100) if r.name == "turn"] == [a.run_id]
    assert [e.content for e in ts.events.list(Scope.session("counter", "ada", "s1"), limit=100)] == ["hi", "run 1: hi"]


# -- must show: a host killed after the reply, before the embedding --------------------------------------------

NOTES = "async def on_message(ctx, message):\n    return 'Noted.'\n"
SAID = "My cat Whiskers knocked the blue vase off the shelf."


class Up:
    """A ``moorage up`` child process on one data dir (``script``: run that file instead of the CLI), on a port the
    kernel picks."""

    def __init__(self, data: Path, script: Path | None = None) -> None:
        self.data = data
        self.url = ""
        self.env = {**os.environ, "MOORAGE_DATA_DIR": str(data), "MOORAGE_PORT": "0",
                    "MOORAGE_SANDBOX_DRIVER": "process", "MOORAGE_LOG_LEVEL": "warning"}
        argv = [sys.executable, str(script)] if script else [sys.executable, "-m", "moorage.cli.main", "up"]
        self.log = data.parent / "server.log"
        with open(self.log, "ab") as logf:
            self.proc = subprocess.Popen(argv, env=self.env, cwd=ROOT, stdout=logf, stderr=logf)

    def wait_healthy(self, timeout: float = 120) -> None:
        self.url = wait_serving(self.proc, self.data, timeout, output=lambda: self.log.read_text(errors="replace"))

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


def _unembedded(data: Path) -> list[Any]:
    store = open_store(Config(data_dir=data, sandbox_driver="process"))
    try:
        (ts,) = list(store.operator.tenants())
        return ts.events.unembedded()
    finally:
        store.close()


@pytest.mark.timeout(300)
def test_a_turn_whose_embedding_a_killed_host_never_ran_is_found_by_meaning_after_restart(tmp_path: Path) -> None:
    data = tmp_path / "data"
    first = Up(data, ROOT / "tests" / "runtime" / "stalled_embedding_up.py")
    second = None
    try:
        first.wait_healthy()
        headers = {"Authorization": f"Bearer {(data / 'local-admin.key').read_text().strip()}"}
        r = httpx.post(f"{first.url}/v1/agents/notes/deployments", headers={**headers, "Content-Type": "application/gzip"},
                       content=tar_dir(write_agent(tmp_path / "notes", "notes", NOTES)), timeout=300)
        assert r.status_code in (200, 201), r.text
        r = httpx.post(f"{first.url}/v1/agents/notes/invoke", headers=headers, timeout=120,
                       json={"user": "ada", "message": SAID})
        assert r.status_code == 200 and r.json()["reply"] == "Noted.", r.text

        # The reply is out and both messages are durable, but the embedding never ran: kill the host now.
        pending = _unembedded(data)
        assert sorted((e.speaker, e.content) for e in pending) == [("assistant", "Noted."), ("user", SAID)]
        first.kill()

        second = Up(data)
        second.wait_healthy()
        # The restart embeds what the killed host left (Runtime.recover submits every tenant).
        deadline = time.monotonic() + 120
        while _unembedded(data):
            assert time.monotonic() < deadline, "the restarted host did not embed the messages"
            time.sleep(0.2)
        store = open_store(Config(data_dir=data, sandbox_driver="process"))
        try:
            (ts,) = list(store.operator.tenants())
            (said,) = [e for e in pending if e.speaker == "user"]
            ((_, blob),) = ts.events.embeddings(said.scope, ids=[said.id])
        finally:
            store.close()
        assert float(np.dot(from_bytes(blob), default_embedder().embed_one(SAID))) > 0.99

        # Memory search finds it by meaning: no word of the query is in the message.
        r = httpx.get(f"{second.url}/v1/agents/notes/users/ada/events/search", headers=headers, timeout=60,
                      params={"q": "pet broke a pot", "session": "default", "k": "1"})
        assert r.status_code == 200, r.text
        assert [h["event"]["content"] for h in r.json()["data"]] == [SAID]
    finally:
        first.stop()
        if second is not None:
            second.stop()
        stop_sandboxes(data)
