"""Shapes of the API's answers as TypedDicts (plain dicts at run time, typed for editors and checkers).

Fields follow docs/api.md and /openapi.json; the server may add fields, never remove these.
"""

from __future__ import annotations

from typing import Any, Generic, TypedDict, TypeVar

Item = TypeVar("Item")


class Page(TypedDict, Generic[Item]):
    data: list[Item]
    next_cursor: str | None


class Agent(TypedDict, total=False):
    id: str
    name: str
    config: dict[str, Any]
    live_deployment: str | None
    created_at: float
    updated_at: float
    version: int


class Deployment(TypedDict, total=False):
    id: str
    agent_id: str
    number: int
    #: The package's ``[agent]`` table as deployed, and the package's digest.
    manifest: dict[str, Any]
    package_sha256: str
    #: ``building``, ``ready``, ``failed``; ``deleted`` only in the answer to its delete.
    status: str
    created_at: float


class Retention(TypedDict, total=False):
    agent: str
    ttl_s: float | None
    zero_retention: bool


class TenantRetention(TypedDict, total=False):
    #: TTL per kind: ``session``, ``user``, ``workflow``, ``executions``, ``usage`` (None: kept).
    ttl_s: dict[str, float | None]
    #: Agents with a TTL or zero retention of their own.
    agents: list[Retention]


class User(TypedDict, total=False):
    agent: str
    id: str
    metadata: dict[str, Any]
    limits: dict[str, float]
    created_at: float
    updated_at: float
    instance: dict[str, Any] | None


class Event(TypedDict, total=False):
    id: int
    scope: str
    ts: float
    kind: str
    speaker: str | None
    content: str
    meta: dict[str, Any]


class SearchHit(TypedDict, total=False):
    """One hit of ``search_events``, in the shape the agent's ``ctx.memory.recall`` returns too (docs/memory.md)."""
    id: int
    #: The event's ``content``.
    text: str
    speaker: str | None
    ts: float
    kind: str
    scope: str
    meta: dict[str, Any]
    score: float
    event: Event


class Forgotten(TypedDict, total=False):
    agent: str
    user: str
    removed: int
    deleted: bool


class AgentDeleted(TypedDict, total=False):
    agent: str
    deleted: bool
    users: int
    removed: int


class UserToken(TypedDict):
    token: str
    agent: str
    user: str
    expires_at: float


class Turn(TypedDict, total=False):
    turn_id: str
    status: str  # done | waiting
    reply: Any
    trace_id: str
    interrupt: Any
    run_id: str | None
    #: The model tokens the turn used: ``input_tokens``, ``output_tokens``.
    usage: dict[str, int]


class Execution(TypedDict, total=False):
    id: str
    object: str  # "execution"
    kind: str  # turn | exec
    agent: str
    user: str
    session: str
    #: turn: queued | running | waiting | succeeded | failed | cancelled;
    #: exec: running | succeeded | failed | timed_out | cancelled | interrupted
    status: str
    reply: Any
    error: str | None
    interrupt: Any
    run_id: str | None
    trace_id: str | None
    events: list[dict[str, Any]]
    created_at: float
    updated_at: float


class ExecExecution(Execution, total=False):
    """A detached exec (``kind == "exec"``): the newest output kept per stream, ``truncated`` when older was dropped."""

    sandbox_id: str
    argv: list[str]
    timeout_s: float
    exit_code: int | None
    stdout: str
    stderr: str
    stdout_bytes: int
    stderr_bytes: int
    truncated: bool


class ExecResult(TypedDict, total=False):
    sandbox_id: str
    argv: list[str]
    status: str  # succeeded | failed | timed_out
    exit_code: int | None
    timed_out: bool
    stdout: str
    stderr: str
    truncated: bool
    duration_s: float


class Webhook(TypedDict, total=False):
    id: str
    agent: str
    url: str
    events: list[str]
    enabled: bool
    created_at: float
    secret: str | None


class Delivery(TypedDict, total=False):
    id: str
    webhook_id: str
    event: str
    status: str  # pending | delivered | failed
    attempts: int
    next_attempt_at: float | None
    created_at: float
    updated_at: float
    payload: dict[str, Any]
    attempt_log: list[dict[str, Any]]


class ApiKey(TypedDict, total=False):
    id: str
    scopes: list[str]
    label: str
    agent: str | None
    created_at: float
    revoked_at: float | None
    secret: str | None


class Whoami(TypedDict):
    kind: str
    key_id: str | None
    scopes: list[str]
    agent: str | None
    user: str | None


class UsageDay(TypedDict):
    day: str
    totals: dict[str, float]


class CapStanding(TypedDict):
    limit: float
    #: As the check before each turn counts it (the compute cap: recorded seconds plus an awake instance's running part).
    used: float
    #: When a windowed cap resets; None for ``store_mib``, a level (what the store keeps for the user now, in MiB).
    resets_at: float | None


class StorageStanding(TypedDict):
    #: The operator's ``tenant_max_storage_mib``, in MiB.
    limit: float
    #: What the tenant keeps, in MiB, as its next write is judged.
    used: float
    #: The measure's parts: the tenant's store, its instances' disk, snapshot and checkpoint bytes at their last
    #: sleep, and its deploy packages (each once).
    store_bytes: int
    instance_bytes: int
    package_bytes: int


class Usage(TypedDict, total=False):
    since: float
    #: The window's end, exclusive (None: no end).
    until: float | None
    totals: dict[str, float]
    cost_usd: float
    #: With ``group="day"``: the same per UTC day.
    days: list[UsageDay]
    #: With ``agent`` and ``user``: each of the user's caps (``compute_seconds_per_day``, ``tokens_per_month``, ...).
    caps: dict[str, CapStanding]
    #: Without ``agent`` and ``user``, where the operator sets ``tenant_max_storage_mib``: what the tenant keeps.
    storage: StorageStanding


class StreamEvent(TypedDict):
    #: token | tool | event | done (a turn); output | end (an exec). An ``error`` event is raised as an ApiError.
    event: str
    data: Any


class Secret(TypedDict, total=False):
    agent: str
    #: None: the agent's secret; else the end-user whose own it is.
    user: str | None
    name: str
    version: int
    created_at: float
    updated_at: float


class ShareLink(TypedDict, total=False):
    id: str
    agent: str
    user: str
    label: str
    created_at: float
    expires_at: float
    revoked_at: float | None
    #: Only in the answer that created it: the link's token and its path on the server (``/v1/shared/TOKEN/``).
    token: str
    url: str
