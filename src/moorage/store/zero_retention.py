"""Zero retention per agent: the setting (in the agent's config) and the purge that leaves nothing of an
agent's finished turns in the store — messages, memory, facts, runs and their journal, traces, executions.

What stays is what the service itself needs: the user's sandbox record, the usage ledger (caps, billing), the
agent-user row, and anything still in use (a turn in flight or waiting for a human, an async execution whose
outcome has not been announced yet; those go in a later purge).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Sequence

from moorage.errors import ConflictError, InvalidInput
from moorage.store.model import Agent, check_id
from moorage.store.sql import dumps, loads

if TYPE_CHECKING:
    from moorage.store.tenant import TenantStore

#: Where the setting lives in the agent's config (``agents.config``): ``{"retention": {"zero_retention": true}}``.
CONFIG_KEY = "retention"
#: Run statuses after which a run holds nothing a turn still needs.
FINISHED = ("succeeded", "failed", "cancelled")
#: Tables whose rows belong to a scope and are content (the sandbox record and the usage ledger are not).
_CONTENT_TABLES = ("state", "events", "facts", "spans")
#: Fields of a delivered webhook payload that carry what the user or the agent said (a turn's; a fact's).
_PAYLOAD_CONTENT = ("reply", "error", "interrupt", "subject", "attribute", "value")


def is_zero(agent: Agent) -> bool:
    """Whether ``agent`` keeps nothing of its turns after they end."""
    return bool(((agent.config or {}).get(CONFIG_KEY) or {}).get("zero_retention"))


def set_zero(ts: "TenantStore", agent_name: str, on: bool) -> Agent:
    """Turn zero retention on or off for ``agent_name`` (compare-and-set on the agent's config)."""
    if not isinstance(on, bool):
        raise InvalidInput(f"zero_retention must be true or false, not {on!r}")
    for _ in range(16):
        agent = ts.agents.get(agent_name)
        if is_zero(agent) == on:
            return agent
        section = {**((agent.config or {}).get(CONFIG_KEY) or {}), "zero_retention": on}
        try:
            agent = ts.agents.update(agent.id, expected_version=agent.version,
                                     config={**(agent.config or {}), CONFIG_KEY: section})
        except ConflictError:
            continue  # a deploy changed the agent meanwhile: read it again
        if on:
            purge(ts, agent.name)  # what earlier turns left goes now, not at the next turn
        return agent
    raise ConflictError(f"agent {agent_name!r} kept changing while its retention was set", hint="retry the request")


def purge(ts: "TenantStore", agent: str, user: str | None = None) -> int:
    """Delete what finished turns of ``agent`` (one user's, or every user's) left in the store, in one
    transaction. Returns the number of rows deleted or scrubbed."""
    check_id(agent, "agent id")
    if user is not None:
        check_id(user, "user id")
    who, params = ("agent_id = ? AND user_id = ?", (agent, user)) if user is not None else ("agent_id = ?", (agent,))
    n = 0
    with ts._tx() as c:  # noqa: SLF001 - a store module, inside the tenant's own transaction
        keys = [r[0] for r in c.q(f"SELECT scope FROM scopes WHERE {who}", params)]
        # Executions whose outcome is not announced yet keep their run (the webhook and GET read it there).
        pending = {r[0] for r in c.q(
            f"SELECT id FROM executions WHERE {who} AND (announced IS NULL OR announced = 'waiting')", params)}
        runs: list[str] = []
        live: set[str] = set()
        for chunk in _chunks(keys):
            marks = ",".join("?" * len(chunk))
            for run_id, status, scope in c.q(f"SELECT id, status, scope FROM workflow_runs WHERE scope IN ({marks})",
                                             chunk):
                if status in FINISHED and run_id not in pending:
                    runs.append(run_id)
                else:
                    live.add(scope)
        for chunk in _chunks(runs):
            marks = ",".join("?" * len(chunk))
            n += c.x(f"DELETE FROM steps WHERE run_id IN ({marks})", chunk)
            n += c.x(f"DELETE FROM journal WHERE run_id IN ({marks})", chunk)
            n += c.x(f"DELETE FROM workflow_runs WHERE id IN ({marks})", chunk)
        # A run in flight keeps its workflow scope's rows (its journal, its spans) until it finishes.
        content = [k for k in keys if k not in live]
        for chunk in _chunks(content):
            marks = ",".join("?" * len(chunk))
            for table in _CONTENT_TABLES:
                n += c.x(f"DELETE FROM {table} WHERE scope IN ({marks})", chunk)
            n += c.x(f"DELETE FROM journal WHERE scope IN ({marks}) AND (run_id IS NULL OR run_id NOT IN "
                     f"(SELECT id FROM workflow_runs))", chunk)
        # Scopes left with no sandbox and no run in flight are forgotten too (their ids name sessions).
        held = set(live)
        for chunk in _chunks(keys):
            marks = ",".join("?" * len(chunk))
            held |= {r[0] for r in c.q(f"SELECT scope FROM sandboxes WHERE scope IN ({marks})", chunk)}
        gone = [k for k in keys if k not in held]
        for chunk in _chunks(gone):
            marks = ",".join("?" * len(chunk))
            n += c.x(f"DELETE FROM scopes WHERE scope IN ({marks})", chunk)
        n += c.x(f"DELETE FROM sessions WHERE {who}", params)
        # Announced turn executions go whole (input, streamed events); detached execs are sandbox operations.
        n += c.x(f"DELETE FROM executions WHERE {who} AND announced IN ('succeeded', 'failed', 'cancelled')", params)
        n += _scrub_deliveries(ts, c, agent, user)
    return n


def _scrub_deliveries(ts: "TenantStore", c: Any, agent: str, user: str | None) -> int:
    """Delivered webhook events of the agent keep their log entry (status, attempts) but not what was said."""
    n = 0
    for (hook_id,) in c.q("SELECT id FROM webhooks WHERE agent_id = ?", (agent,)):
        for dlv_id, payload in c.q("SELECT id, payload FROM webhook_deliveries WHERE webhook_id = ? AND status = "
                                   "'delivered'", (hook_id,)):
            doc = loads(payload) or {}
            data = doc.get("data") if isinstance(doc, dict) else None
            if not isinstance(data, dict) or (user is not None and data.get("user") != user):
                continue
            if all(data.get(k) is None for k in _PAYLOAD_CONTENT):
                continue
            doc["data"] = {**data, **{k: None for k in _PAYLOAD_CONTENT if k in data}}  # each event keeps its shape
            n += c.x("UPDATE webhook_deliveries SET payload = ?, updated_at = ?, version = version + 1 WHERE id = ?",
                     (dumps(doc, ts.max_value_bytes, "webhook payload"), time.time(), dlv_id))
    return n


def sweep(ts: "TenantStore") -> int:
    """Purge every zero-retention agent of the tenant (what async executions kept until announced)."""
    return sum(purge(ts, a.name) for a in ts.agents.list() if is_zero(a))


def _chunks(items: Sequence[str], size: int = 500) -> list[list[str]]:
    return [list(items[i:i + size]) for i in range(0, len(items), size)]
