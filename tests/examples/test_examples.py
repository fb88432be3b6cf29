"""The examples in examples/, end to end through the real runtime (process sandboxes, embedded model)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest

from moorage.store import EntityKey, Scope

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


async def test_assistant_remembers_preferences_across_sessions(env) -> None:
    await env.runtime.deploy(env.principal, EXAMPLES / "assistant")
    day1 = EntityKey("assistant", "ada", session="monday")
    r1 = await env.runtime.invoke(env.principal, day1, "Hi! My name is Ada and I prefer green tea over coffee.")
    assert r1.status == "done" and r1.reply
    # Days later, a new session: the sandbox may have slept; memory lives in the store.
    ts = env.store.tenant(env.principal)
    await env.manager.sleep(ts, Scope.for_user("assistant", "ada"))
    day5 = EntityKey("assistant", "ada", session="friday")
    r2 = await env.runtime.invoke(env.principal, day5, "What do I prefer to drink?")
    assert "green tea" in r2.reply.lower()
    # Asking about a preference did not overwrite it.
    from moorage.memory import SemanticMemory

    prefs = SemanticMemory(ts).recall(Scope.for_user("assistant", "ada"), attribute="prefers")
    assert [f.value for f in prefs] == ["green tea over coffee"]
    # Another user of the same agent knows nothing of Ada: nothing of hers is in his memory, so his turn states
    # nothing from it. (Not checked in his reply's words: the model samples freely and may suggest any drink.)
    r3 = await env.runtime.invoke(env.principal, EntityKey("assistant", "bob"), "What do I prefer to drink?")
    assert r3.status == "done" and "what i remember about you" not in r3.reply.lower()
    from moorage.memory import EpisodicMemory

    assert SemanticMemory(ts).recall(Scope.for_user("assistant", "bob"), include_pending=True) == []
    query, said = "Ada prefers green tea over coffee", "my name is ada"
    assert any(said in r.event.content.lower()
               for r in EpisodicMemory(ts).search(Scope.session("assistant", "ada", "monday"), query, k=50))
    bobs = EpisodicMemory(ts).search(Scope.session("assistant", "bob", "default"), query, k=50)
    assert bobs and all(said not in r.event.content.lower() for r in bobs)


async def test_coder_installs_a_package_that_stays_between_sessions(env) -> None:
    await env.runtime.deploy(env.principal, EXAMPLES / "coder")
    k = EntityKey("coder", "dev", session="s1")
    assert (await env.runtime.invoke(env.principal, k, "install")).reply == "installed slugkit"
    assert (await env.runtime.invoke(env.principal, k, "write")).reply == "wrote projects/slug.py"
    ts = env.store.tenant(env.principal)
    assert await env.manager.sleep(ts, Scope.for_user("coder", "dev"))
    k2 = EntityKey("coder", "dev", session="s2")
    assert (await env.runtime.invoke(env.principal, k2, "run Hello moorage World")).reply == "hello-moorage-world"
    assert "slug.py" in (await env.runtime.invoke(env.principal, k2, "ls projects")).reply


class _Payments(BaseHTTPRequestHandler):
    applied: dict[str, int] = {}
    seen: list[str] = []
    lock = threading.Lock()

    def do_POST(self) -> None:  # noqa: N802
        key = self.headers.get("Idempotency-Key", "")
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
        with self.lock:
            self.seen.append(key)
            if key not in self.applied:
                self.applied[key] = len(self.applied) + 1
            receipt = f"r{self.applied[key]}-{body['order']}"
        data = json.dumps({"receipt": receipt}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a: object) -> None:
        pass


@pytest.fixture
def payments() -> Iterator[str]:
    _Payments.applied, _Payments.seen = {}, []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Payments)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/pay"
    srv.shutdown()


async def test_refund_workflow_waits_for_approval_and_pays_once(env, payments: str) -> None:
    await env.runtime.deploy(env.principal, EXAMPLES / "approval")
    k = EntityKey("refunds", "ops")
    r = await env.runtime.invoke(env.principal, k, f"refund 42 30 {payments}")
    assert r.status == "waiting" and "Refund 30.00 for order 42" in r.interrupt["question"]
    assert _Payments.seen == []  # nothing paid before the human said yes
    # The sandbox sleeps while the human thinks; the answer resumes the run from the interrupt.
    ts = env.store.tenant(env.principal)
    await env.manager.sleep(ts, Scope.for_user("refunds", "ops"))
    done = await env.runtime.answer(env.principal, r.run_id, "yes")
    assert done.reply == "refunded 30.00 for order 42, receipt r1-42"
    assert len(_Payments.applied) == 1
    # Answering again is refused (the run is finished) and pays nothing more.
    from moorage.errors import ConflictError

    with pytest.raises(ConflictError):
        await env.runtime.answer(env.principal, r.run_id, "yes")
    assert len(_Payments.applied) == 1 and len(set(_Payments.seen)) == 1


async def test_egress_is_limited_to_the_manifest(env, tmp_path: Path) -> None:
    agent = tmp_path / "leaky"
    agent.mkdir()
    (agent / "moorage.toml").write_text('[agent]\nname = "leaky"\nentry = "agent.py"\n[agent.lifecycle]\nusers = "auto"\n')
    (agent / "agent.py").write_text(
        "async def on_message(ctx, m):\n"
        "    try:\n"
        "        await ctx.fetch(m)\n"
        "        return 'fetched'\n"
        "    except Exception as e:\n"
        "        return 'refused: ' + str(e)\n"
    )
    await env.runtime.deploy(env.principal, agent)
    r = await env.runtime.invoke(env.principal, EntityKey("leaky", "u"), "http://127.0.0.1:9/")
    assert r.reply.startswith("refused") and "not allowed" in r.reply
