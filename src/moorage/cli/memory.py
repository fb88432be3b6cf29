"""``moorage memory``: evaluate retrieval, generate evaluation sets, inspect a user's facts and memories, and
list, confirm or reject the facts that wait for confirmation.

Rendering only; the work is done by ``moorage.memory`` (``facts``, ``search``: the store, operator access) or by
the server through the SDK (``pending``, ``confirm``, ``reject``: the configured key).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional

import typer
from rich.markup import escape
from rich.table import Table

from moorage.cli.console import id_column, make_console, print_table, utc

app = typer.Typer(no_args_is_help=True, help="Agent memory: evaluation, facts and recall.")
eval_app = typer.Typer(invoke_without_command=True, help="Retrieval quality: moorage vs BM25-only vs dense-only.")
app.add_typer(eval_app, name="eval")
console = make_console()


@eval_app.callback()
def eval_run(
    ctx: typer.Context,
    dataset: Optional[Path] = typer.Option(None, "--dataset", help="Dataset file (format in docs/memory.md)."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Score recall@1/5/10 and MRR of moorage's retriever, BM25 alone and dense alone on DATASET."""
    if ctx.invoked_subcommand is not None:
        return
    if dataset is None:
        from moorage.errors import InvalidInput

        raise InvalidInput("no dataset given", hint="pass --dataset FILE, or make one: moorage memory eval generate --out FILE")
    from moorage.memory import evalset
    from moorage.memory.evaluate import evaluate

    ds = evalset.load(dataset)
    progress = None if as_json else (lambda line: console.print(f"[dim]{line}[/]", highlight=False))
    report = evaluate(ds, progress=progress)
    if as_json:
        print(json.dumps(report.as_dict(), indent=2))
        return
    console.print(f"{report.dataset}: {report.conversations} conversations, {report.turns} turns, {report.questions} questions")
    table = Table("system", "recall@1", "recall@5", "recall@10", "MRR")
    for name, s in report.systems.items():
        label = f"{name} (rank-bm25 {report.bm25_version})" if name == "bm25" else name
        table.add_row(label, *(f"{s[m]:.3f}" for m in ("recall@1", "recall@5", "recall@10", "mrr")))
    console.print(table)
    by_type = Table("question type", *report.systems.keys(), title="recall@5 by question type")
    for qtype, per in report.by_type.items():
        by_type.add_row(f"{qtype} ({per['moorage']['questions']:.0f})", *(f"{per[s]['recall@5']:.3f}" for s in report.systems))
    console.print(by_type)
    console.print(f"ingest (embedding + store): {report.ingest_events_per_s:.0f} events/s")


@eval_app.command("generate")
def eval_generate(
    out: Path = typer.Option(..., "--out", help="Where to write the dataset (JSON)."),
    seed: int = typer.Option(7, "--seed", help="Same seed, same file."),
    conversations: int = typer.Option(6, "--conversations", min=1, help="Simulated users, one conversation each."),
    sessions: int = typer.Option(10, "--sessions", min=1, help="Sessions per conversation."),
    turns: int = typer.Option(24, "--turns", min=4, help="Turns per session."),
) -> None:
    """Write a generated multi-session dataset with planted facts, updates, distractors and questions."""
    from moorage.memory import evalset

    ds = evalset.generate(seed=seed, conversations=conversations, sessions=sessions, turns_per_session=turns)
    ds.save(out)
    n_q = sum(len(c.questions) for c in ds.conversations)
    n_t = sum(len(c.turns()) for c in ds.conversations)
    console.print(f"wrote {out}: {len(ds.conversations)} conversations, {n_t} turns, {n_q} questions (seed {seed})", highlight=False)


def _tenant_store(tenant: str):  # noqa: ANN202 - returns (Store, TenantStore)
    from moorage.cli.main import state
    from moorage.cli.store import NO_STORE_HINT, store_missing
    from moorage.errors import NotFound
    from moorage.store import open_store

    missing = store_missing(state.cfg)
    if missing is not None:  # reading makes no store
        raise NotFound(f"no store yet at {missing}, so no tenant {tenant!r}", hint=NO_STORE_HINT)

    store = open_store(state.cfg)
    try:
        t = store.operator.get_tenant(tenant)
    except Exception:  # an unknown tenant: the store is not left open
        store.close()
        raise
    return store, store.tenant(store.operator.principal(t.id))


def _agent_of(ts, tenant: str, agent: str, user: str) -> str:  # type: ignore[no-untyped-def]
    """The name of ``agent`` (given by name or id) once it and its ``user`` are known in the tenant: a mistyped
    --agent or --user is an error, not an empty list. A user is known as the API knows one
    (``TenantStore.knows_user``)."""
    from moorage.errors import NotFound

    try:
        name = ts.agents.get(agent).name
    except NotFound:
        raise NotFound(f"tenant {tenant!r} has no agent {agent!r}",
                       hint="check --agent; `moorage agents` lists them (with the tenant's API key)") from None
    if not ts.knows_user(name, user):
        raise NotFound(f"agent {name!r} of tenant {tenant!r} has no user {user!r}",
                       hint=f"check --user; `moorage users {name}` lists them (with the tenant's API key)")
    return name


@app.command("facts")
def facts(
    tenant: str = typer.Option(..., "--tenant", help="Tenant name or id (operator access)."),
    agent: str = typer.Option(..., "--agent", help="The agent."),
    user: str = typer.Option(..., "--user", help="The end-user, by the agent's id for them."),
    pending: bool = typer.Option(False, "--pending", help="Show facts waiting for confirmation instead."),
    history: bool = typer.Option(False, "--history", help="Include superseded facts."),
    as_json: bool = typer.Option(False, "--json", help="The facts as JSON."),
) -> None:
    """List a user's trusted facts (or pending ones), with trust, validity and provenance."""
    from moorage.memory.semantic import SemanticMemory
    from moorage.store import Scope

    store, ts = _tenant_store(tenant)
    try:
        scope = Scope.for_user(_agent_of(ts, tenant, agent, user), user)
        mem = SemanticMemory(ts)
        rows = mem.pending(scope) if pending else ts.facts.list(scope, include_closed=history, limit=None)
    finally:
        store.close()
    if as_json:
        print(json.dumps({"data": [{**f.__dict__, "scope": f.scope.key} for f in rows]}, indent=2))
        return
    table = Table(id_column("id"), "attribute", "value", "trust", "status", "valid from", "valid to", "provenance")
    for f in rows:
        table.add_row(f.id, f.attribute, f.value, f.trust, f.status, f"{f.valid_from:.0f}",
                      "" if f.valid_to is None else f"{f.valid_to:.0f}", ",".join(f.provenance))
    print_table(console, table)


@app.command("search")
def search(
    query: str = typer.Argument(..., help="What to recall."),
    tenant: str = typer.Option(..., "--tenant", help="Tenant name or id (operator access)."),
    agent: str = typer.Option(..., "--agent", help="The agent."),
    user: str = typer.Option(..., "--user", help="The end-user, by the agent's id for them."),
    k: int = typer.Option(10, "-k", min=1, max=100, help="How many results (1 to 100)."),
    session: Optional[str] = typer.Option(None, "--session", "-s",
                                          help="Search this session's scope (its turn messages) instead of the user's."),
    as_json: bool = typer.Option(False, "--json", help="The API's search result (GET …/events/search)."),
) -> None:
    """Hybrid search of one user's episodic memory (or of one session's)."""
    from moorage.memory.episodic import EpisodicMemory
    from moorage.store import Scope

    store, ts = _tenant_store(tenant)
    try:
        agent = _agent_of(ts, tenant, agent, user)
        scope = Scope.session(agent, user, session) if session else Scope.for_user(agent, user)
        hits = EpisodicMemory(ts).search(scope, query, k=k)
    finally:
        store.close()
    if as_json:
        print(json.dumps({"data": [{**h.as_json(), "lexical_rank": h.lexical_rank, "dense_rank": h.dense_rank}
                                   for h in hits]}, indent=2))
        return
    table = Table("score", "lexical", "dense", "speaker", "content")
    for h in hits:
        table.add_row(f"{h.score:.3f}", str(h.lexical_rank or "-"), str(h.dense_rank or "-"), h.event.speaker or "",
                      h.event.content[:120])
    console.print(table)


# -- pending facts, through the server ------------------------------------------------------------------------

SESSION = typer.Option(None, "--session", "-s", help="A session's facts instead of the user's (where turns put them).")
JSON = typer.Option(False, "--json", help="The API's answer, as it is.")


def _sdk(use: Callable[[Any], Any]) -> Any:
    from moorage.cli.client import sdk
    from moorage.cli.main import state

    return sdk(state.cfg, use)


@app.command("pending")
def pending(agent: str = typer.Argument(..., help="The agent."), user: str = typer.Argument(..., help="Its end-user."),
            session: Optional[str] = SESSION, as_json: bool = JSON) -> None:
    """List USER's facts that wait for confirmation (what AGENT learned, what a tool said), oldest first."""
    rows = _sdk(lambda c: list(c.paginate(c.list_pending_facts, agent, user, session=session)))
    if as_json:
        print(json.dumps({"data": rows}, indent=2))
        return
    if not rows:
        console.print(f"no facts of user {escape(user)} of {escape(agent)} wait for confirmation", highlight=False)
        return
    table = Table(id_column("id"), "subject", "attribute", "value", "source", "trust", "recorded")
    for f in rows:
        table.add_row(f["id"], *(escape(str(f[k])) for k in ("subject", "attribute", "value", "source", "trust")),
                      utc(f["recorded_at"]))
    print_table(console, table)
    console.print(f"decide one: moorage memory confirm {escape(agent)} {escape(user)} FACT_ID (or reject)",
                  highlight=False)


def _decided(out: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(out, indent=2))
        return
    f, before = out["fact"], out.get("previous")
    said = f"{out['action']} {f['id']}: {f['subject']} {f['attribute']} = {f['value']}"
    if out["action"] == "merged":
        said += " (already believed: the pending fact was folded into it)"
    elif before:
        said += f" (was {before['value']})"
    console.print(escape(said), highlight=False)


@app.command("confirm")
def confirm(agent: str = typer.Argument(..., help="The agent."), user: str = typer.Argument(..., help="Its end-user."),
            fact_id: str = typer.Argument(..., metavar="FACT_ID", help="From `moorage memory pending`."),
            session: Optional[str] = SESSION, as_json: bool = JSON) -> None:
    """Confirm a pending fact: it is USER's current value from now on, superseding the one before."""
    _decided(_sdk(lambda c: c.confirm_fact(agent, user, fact_id, session=session)), as_json)


@app.command("reject")
def reject(agent: str = typer.Argument(..., help="The agent."), user: str = typer.Argument(..., help="Its end-user."),
           fact_id: str = typer.Argument(..., metavar="FACT_ID", help="From `moorage memory pending`."),
           session: Optional[str] = SESSION, as_json: bool = JSON) -> None:
    """Reject a pending fact: it is never believed (kept on record as rejected)."""
    _decided(_sdk(lambda c: c.reject_fact(agent, user, fact_id, session=session)), as_json)
