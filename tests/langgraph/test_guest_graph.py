"""Example 5 (examples/langgraph) end to end on process sandboxes: an unchanged LangGraph graph whose
checkpointer is moorage's store reached over the channel (bound to the turn's user), its interrupt() as a
moorage interrupt resumed through the runtime's answer path, and time travel moving the graph's checkpoints
with the rest of the instance. LangGraph reaches the sandbox the documented way: the example's requirements.txt,
installed at deploy time from a package index (a loopback one serving wheels repacked from this venv)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import AsyncIterator, Iterator

import pytest
import pytest_asyncio

from moorage.config import Config
from moorage.egress import Egress, OperatorPolicy, StaticResolver
from moorage.lifecycle.manager import InstanceManager
from moorage.llm import gateway_from_config
from moorage.runtime.graph_calls import PREFIX, GraphRows, _ns_key
from moorage.runtime.runtime import Runtime
from moorage.store import EntityKey, Scope, open_store
from tests.conftest import stop_all_sandboxes
from tests.langgraph.wheelhouse import build_index, serve
from tests.llm.wire_servers import MODEL, Canned, WireServer, openai_app
from tests.runtime.conftest import Env

pytestmark = pytest.mark.asyncio(loop_scope="module")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "langgraph"
AGENT = "notebook"


@pytest.fixture(scope="module")
def wire() -> Iterator[WireServer]:
    """The model: an OpenAI-wire server on loopback answering the plan node's question from a script."""
    with WireServer(openai_app, "sk-test") as w:
        yield w


def will_say(wire: WireServer, text: str) -> None:
    wire.script.push(Canned(body={"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": MODEL,
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                               "finish_reason": "stop"}],
                                  "usage": {"prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25}}))


@pytest.fixture(scope="module")
def index() -> Iterator[int]:
    with tempfile.TemporaryDirectory(prefix="lg-index-") as root:
        build_index(Path(root), "langgraph")
        yield from serve(Path(root))


async def _env(tmp: Path, index: int, wire: WireServer, driver_name: str) -> AsyncIterator[Env]:
    from tests.sandbox.conftest import DRIVER_FACTORIES

    # The index by a name that the gateway's resolver maps to loopback, an address the operator's policy admits
    # here: pip in the template's builder reaches it through the egress relay on the channel and the host's gateway
    # (both drivers; the micro-VM's NIC and 10.0.2.2:3128 are for agents with [agent.network], not deploys).
    url = f"http://pypi.test:{index}"
    cfg = Config(data_dir=tmp / "data", sandbox_driver=driver_name, egress_allow_cidrs="127.0.0.0/8",
                 egress_package_index=url, package_index_url=url + "/simple/", llm_provider="openai",
                 llm_base_url=f"{wire.url}/v1", llm_api_key="sk-test", llm_model=MODEL)
    store = open_store(cfg)
    principal = store.authenticate(store.operator.create_tenant("acme")[1].secret)
    driver = DRIVER_FACTORIES[driver_name](cfg.sandboxes_dir, cfg)
    manager = InstanceManager(store, driver)
    await manager.start()
    rt = Runtime(cfg, store, driver, gateway_from_config(cfg), manager)
    rt.egress = rt.templates.egress = Egress(OperatorPolicy.from_config(cfg), StaticResolver({"pypi.test": ["127.0.0.1"]}))
    try:
        yield Env(rt, manager, principal, cfg)
    finally:
        await rt.aclose()  # its background work ends before what it uses closes
        await manager.close()
        await stop_all_sandboxes(driver)
        await driver.close()
        store.close()


def example_copy(tmp: Path) -> Path:
    """The example as it is, but checkpoints taken when a test asks (the rollback and fork tests name theirs)."""
    dst = tmp / "langgraph-example"
    shutil.copytree(EXAMPLE, dst)
    manifest = (dst / "moorage.toml").read_text()
    assert "auto = true" in manifest
    (dst / "moorage.toml").write_text(manifest.replace("auto = true", "auto = false"))
    return dst


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env(tmp_path_factory: pytest.TempPathFactory, index: int, wire: WireServer) -> AsyncIterator[Env]:
    tmp = tmp_path_factory.mktemp("lg")
    async for e in _env(tmp, index, wire, "process"):
        await e.runtime.deploy(e.principal, example_copy(tmp))  # pip installs requirements.txt into the template
        yield e


async def ask(env: Env, user: str, message: str, session: str = "default"):
    return await env.runtime.invoke(env.principal, EntityKey(AGENT, user, session), message)


def graph_rows(env: Env, user: str) -> list[str]:
    ts = env.store.tenant(env.principal)
    return [r.key for r in ts.state.list(Scope.for_user(AGENT, user), prefix=PREFIX, limit=10_000)]


async def test_the_graph_keeps_its_state_in_the_users_store_rows(env: Env) -> None:
    assert (await ask(env, "ada", "note buy milk")).reply == "notes: buy milk"
    assert (await ask(env, "ada", "note call mum")).reply == "notes: buy milk, call mum"
    # Another session is another thread of the same user's graph; another user has a graph of their own.
    assert (await ask(env, "ada", "note elsewhere", session="s2")).reply == "notes: elsewhere"
    assert (await ask(env, "bob", "note bob's")).reply == "notes: bob's"
    ada, bob = graph_rows(env, "ada"), graph_rows(env, "bob")
    assert any(k.startswith(PREFIX + "default/") for k in ada) and any(k.startswith(PREFIX + "s2/") for k in ada)
    assert ada and bob and not set(ada) & {k for k in bob if "/c/" in k}
    # The checkpointer's calls carry a thread only, the user is the turn's: a thread id shaped like a path to
    # another user's rows is one escaped segment under the caller's own scope.
    sneaky = _ns_key({"thread": "../../user:notebook/ada/default", "ns": ""})
    assert sneaky.count("/") == 3  # langgraph/<one segment>/-/
    mallory = GraphRows(env.store.tenant(env.principal), Scope.for_user(AGENT, "mallory"))
    assert mallory.get(sneaky, None) is None and mallory.get(_ns_key({"thread": "default", "ns": ""}), None) is None
    # The state survives the sandbox sleeping (the checkpoints are in the store, not the sandbox).
    ts = env.store.tenant(env.principal)
    assert await env.manager.sleep(ts, Scope.for_user(AGENT, "ada"))
    assert (await ask(env, "ada", "note after sleep")).reply == "notes: buy milk, call mum, after sleep"


async def test_each_users_sandbox_reads_the_packages_from_the_template_not_a_copy(env: Env) -> None:
    """The process driver binds the template's installed packages read-only into every user's sandbox: a new
    user's layer (and each checkpoint, each fleet sleep) holds none of LangGraph's files."""
    from moorage.sandbox.process_fs import disk_usage

    assert (await ask(env, "dot", "note one")).reply == "notes: one"
    rec = env.store.tenant(env.principal).sandboxes.for_scope(Scope.for_user(AGENT, "dot"))
    assert rec is not None
    sandbox = env.cfg.sandboxes_dir / rec.id
    meta = json.loads((sandbox / "meta.json").read_text())
    assert meta["shared"]["paths"] == ["work/.moorage/site"]
    template_site = Path(meta["shared"]["dir"]) / "layer" / "work" / ".moorage" / "site"
    assert (template_site / "langgraph").is_dir() and disk_usage(template_site) > 20 << 20
    assert list((sandbox / "layer" / "work" / ".moorage" / "site").iterdir()) == []
    assert disk_usage(sandbox / "layer") < 2 << 20


async def approve_a_plan(env: Env, wire: WireServer) -> None:
    """The graph's interrupt() waits as a moorage interrupt; the answer resumes it without re-planning (both drivers)."""
    will_say(wire, "Use a watering can.")
    first = await ask(env, "cy", "do water the plants")
    assert first.status == "waiting"
    assert first.interrupt["plan"] == "water the plants: Use a watering can."
    assert first.interrupt["question"] == f"Go ahead with '{first.interrupt['plan']}'?"
    ts = env.store.tenant(env.principal)
    assert ts.runs.get(first.run_id).status == "waiting"  # what the API, the webhook and the dashboard show
    done = await env.runtime.answer(env.principal, first.run_id, "yes")
    assert done.status == "done"
    assert done.reply == f"done: {first.interrupt['plan']} (1 done so far)"
    assert ts.runs.get(first.run_id).status == "succeeded"
    # The model was asked once: the resumed turn replayed the journaled graph run, the graph did not re-plan.
    assert not wire.script.queue
    steps = [s.name for s in ts.runs.steps(first.run_id)]
    assert steps.count("langgraph") == 1 and steps.count("langgraph:resume") == 1


async def test_interrupt_waits_as_a_moorage_interrupt_and_the_answer_resumes_the_graph(env: Env,
                                                                                     wire: WireServer) -> None:
    await approve_a_plan(env, wire)
    # A refusal takes the other branch, and the graph's notes are still there on the same thread.
    will_say(wire, "Two coats.")
    second = await ask(env, "cy", "do paint the fence")
    refused = await env.runtime.answer(env.principal, second.run_id, "no")
    assert refused.reply.startswith("not approved: paint the fence")
    assert (await ask(env, "cy", "note ok")).reply == "notes: ok"


async def take(env: Env, user: str, name: str) -> str:
    return (await env.runtime.timetravel.take(env.principal, AGENT, user, name=name)).id


async def test_rollback_and_fork_move_the_graphs_checkpoints_with_the_instance(env: Env) -> None:
    for n in (1, 2):
        await ask(env, "dee", f"note n{n}")
    at2 = await take(env, "dee", "after-n2")
    rows2 = graph_rows(env, "dee")
    for n in (3, 4):
        await ask(env, "dee", f"note n{n}")
    rows4 = graph_rows(env, "dee")
    assert len(rows4) > len(rows2)

    # Fork at turn 2 into a new user: it continues the graph from n1, n2 on its own; the source is unchanged.
    await env.runtime.timetravel.fork(env.principal, AGENT, "dee", at2, to_users=["dee-what-if"])
    assert graph_rows(env, "dee-what-if") == rows2
    assert (await ask(env, "dee-what-if", "note w")).reply == "notes: n1, n2, w"
    assert graph_rows(env, "dee") == rows4

    # Roll back to turn 2: the graph's rows are those of turn 2, and it continues from n1, n2.
    await env.runtime.timetravel.rollback(env.principal, AGENT, "dee", at2)
    assert graph_rows(env, "dee") == rows2
    assert (await ask(env, "dee", "note n3")).reply == "notes: n1, n2, n3"
    # The abandoned branch comes back whole, the graph's state with it.
    listing = await env.runtime.timetravel.list(env.principal, AGENT, "dee")
    tip = next(b["tip"] for b in listing["branches"] if not b["current"])
    await env.runtime.timetravel.rollback(env.principal, AGENT, "dee", tip)
    assert graph_rows(env, "dee") == rows4
    assert (await ask(env, "dee", "note n5")).reply == "notes: n1, n2, n3, n4, n5"


async def test_a_graph_rolled_back_to_before_its_question_asks_again(env: Env, wire: WireServer) -> None:
    await ask(env, "eve", "note start")
    before = await take(env, "eve", "start")
    rows = graph_rows(env, "eve")
    will_say(wire, "With a broom.")
    waiting = await ask(env, "eve", "do sweep the floor")
    assert (await env.runtime.answer(env.principal, waiting.run_id, "yes")).reply.startswith("done: sweep the floor")
    await env.runtime.timetravel.rollback(env.principal, AGENT, "eve", before)
    assert graph_rows(env, "eve") == rows
    will_say(wire, "With a broom.")
    again = await ask(env, "eve", "do sweep the floor")
    assert again.status == "waiting"
    done = await env.runtime.answer(env.principal, again.run_id, "yes")
    assert done.reply.endswith("(1 done so far)")  # the first "done" went with what came after the checkpoint
