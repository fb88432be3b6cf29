"""A real runtime (SQLite store, process sandboxes) and an agent whose every turn writes a file, learns a fact,
records an event and journals a step: what time-travel tests roll back and fork."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, AsyncIterator

import pytest

from moorage.store import Scope, TenantStore
from moorage.store.model import FACT_STATUS
from moorage.store.repos import checkpoint_image
from moorage.store.repos.checkpoints import Checkpoints
from tests.runtime.conftest import Env, make_env

AGENT = '''
import json

async def on_message(ctx, message):
    if message.startswith("turn "):
        n = int(message.split()[1])
        ctx.files.write(f"notes/{n}.txt", f"note {n} for {ctx.user}")
        await ctx.memory.learn("user", "last_turn", str(n), f"the last turn was number {n}")
        await ctx.memory.remember(f"milestone {n} reached by the user")
        got = await ctx.step(f"side-{n}", lambda: n * 10)
        return f"done {n} step={got} files={len(ctx.files.list('notes'))}"
    if message == "ls":
        names = ctx.files.list("notes") if ctx.files.exists("notes") else []
        return json.dumps({n: ctx.files.read("notes/" + n) for n in names})
    if message.startswith("recall "):
        hits = await ctx.memory.recall(message[len("recall "):], k=20)
        return json.dumps(sorted(h["text"] for h in hits))
    return "echo: " + message
'''


#: Automatic checkpoints after every turn are opted into.
TIMETRAVEL = "[agent.timetravel]\nauto = true\n"


def tt_archive(tmp_path: Path, name: str = "tt", body: str = AGENT, manifest: str = TIMETRAVEL) -> bytes:
    """An agent directory packed as the tar.gz a client uploads, with automatic checkpoints on."""
    import io
    import tarfile
    import textwrap

    root = tmp_path / f"agent-src-{name}"
    root.mkdir(parents=True, exist_ok=True)
    (root / "moorage.toml").write_text(f'[agent]\nname = "{name}"\nentry = "agent.py"\n{manifest}'
                                       '[agent.lifecycle]\nusers = "auto"\n')
    (root / "agent.py").write_text(textwrap.dedent(body))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for p in sorted(root.iterdir()):
            tar.add(p, arcname=p.name)
    return buf.getvalue()


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    async for e in make_env(tmp_path, "process"):
        yield e


@pytest.fixture(params=["process", "microvm"])
async def both_env(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Env]:
    """A runtime on each sandbox driver: the issue's must-show scenarios run on both."""
    async for e in make_env(tmp_path, request.param):
        yield e


def store_view(ts: TenantStore, agent: str, user: str) -> dict[str, Any]:
    """What the store holds for one instance, as a reader sees it: facts (all, with validity), events, runs with
    their steps, journal entries and the user's state records."""
    scope = Scope.for_user(agent, user)
    facts = sorted((f.attribute, f.value, f.status, f.valid_from, f.valid_to, f.superseded_by is not None)
                   for f in ts.facts.list(scope, include_closed=True, statuses=FACT_STATUS))
    events = [(e.kind, e.content) for e in ts.events.list(scope, limit=10_000)]
    events += [(e.kind, e.content) for e in ts.events.list(Scope.session(agent, user, "default"), limit=10_000)]
    runs = sorted((r.id, r.status, json.dumps(r.result, sort_keys=True)) for r in ts.runs.list(limit=10_000)
                  if r.scope.user == user and r.scope.agent == agent)
    steps = sorted((r[0], s.seq, s.name, s.status) for r in runs for s in ts.runs.steps(r[0]))
    state = sorted((r.key, r.version) for r in ts.state.list(scope))
    with ts.transaction():
        # Every row read whole: what the incremental manifests must add up to.
        image = checkpoint_image.read(ts.ambient(), agent, user).manifest.rows  # type: ignore[arg-type]
    return {"facts": facts, "events": events, "runs": runs, "steps": steps, "state": state, "image": image}
