"""The store's vocabulary: principals, scopes and the records kept for each tenant.

Plain frozen dataclasses; backends map them to rows. Nothing here does I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from moorage.errors import InvalidInput

ScopeKind = Literal["session", "user", "workflow"]
SCOPE_KINDS: tuple[str, ...] = ("session", "user", "workflow")

#: Identifiers that become part of keys: short, printable, no separators we use ("/" and " ").
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+=-]{0,127}$")

#: What a tenant API key may do. ``admin`` implies every other scope; the others imply nothing but themselves:
#: ``provision`` end-users, ``invoke`` agents (turns, answers, executions), ``deploy`` agents and operate their
#: sandboxes and webhooks, ``secrets`` manage secrets, ``read`` everything else of the tenant.
API_KEY_SCOPES: tuple[str, ...] = ("admin", "deploy", "invoke", "provision", "read", "secrets")
#: Stored among a key's scopes (``agent:<name>``): the key may act on that one agent only.
AGENT_SCOPE_PREFIX = "agent:"


def split_scopes(stored: str) -> tuple[frozenset[str], str | None]:
    """A key's stored scope list as (scopes, the one agent it is limited to or None)."""
    scopes, agent = set(), None
    for part in stored.split(","):
        if part.startswith(AGENT_SCOPE_PREFIX):
            agent = part[len(AGENT_SCOPE_PREFIX):]
        elif part:
            scopes.add(part)
    return frozenset(scopes), agent


def check_id(value: object, what: str) -> str:
    """Validate an identifier that comes from outside (agent name, user id, session id, key)."""
    if not isinstance(value, str) or not _ID_RE.fullmatch(value):
        raise InvalidInput(
            f"malformed {what}: {value!r}",
            hint="use 1-128 characters from A-Z a-z 0-9 . _ : @ + = -, starting with a letter or digit",
        )
    return value


@dataclass(frozen=True)
class Principal:
    """Who is calling, as established by authentication. The only source of a tenant id.

    ``user`` and ``agent`` are set for end-user tokens, which may act for one user of one agent only; ``agent``
    alone is set for an API key limited to one agent.
    """

    tenant_id: str
    scopes: frozenset[str] = frozenset(API_KEY_SCOPES)
    key_id: str | None = None
    agent: str | None = None
    user: str | None = None

    def require(self, scope: str) -> None:
        from moorage.errors import TenantScopeError

        if not self.allows(scope):
            raise TenantScopeError(f"this key lacks the {scope!r} scope", hint=f"use a key with the {scope} scope")

    def allows(self, *scopes: str) -> bool:
        """Whether this principal holds any of ``scopes`` (``admin`` holds them all)."""
        return "admin" in self.scopes or any(s in self.scopes for s in scopes)


@dataclass(frozen=True)
class Scope:
    """What a piece of state belongs to: one session, one user (across sessions) or one workflow run."""

    kind: ScopeKind
    agent: str
    user: str | None = None
    ref: str | None = None  # session id or workflow run id

    def __post_init__(self) -> None:
        if self.kind not in SCOPE_KINDS:
            raise InvalidInput(f"unknown scope kind {self.kind!r}", hint=f"one of {', '.join(SCOPE_KINDS)}")
        check_id(self.agent, "agent id")
        if self.user is not None:
            check_id(self.user, "user id")
        if self.kind in ("session", "workflow"):
            check_id(self.ref, f"{self.kind} id")
        if self.kind in ("session", "user") and self.user is None:
            raise InvalidInput(f"a {self.kind} scope needs a user")
        if self.kind == "user" and self.ref is not None:
            raise InvalidInput("a user scope has no ref")

    @classmethod
    def session(cls, agent: str, user: str, session: str) -> "Scope":
        return cls("session", agent, user, session)

    @classmethod
    def for_user(cls, agent: str, user: str) -> "Scope":
        # Not named ``user``: that is the field.
        return cls("user", agent, user)

    @classmethod
    def workflow(cls, agent: str, run_id: str, user: str | None = None) -> "Scope":
        return cls("workflow", agent, user, run_id)

    @property
    def key(self) -> str:
        """Stable string form stored in every scoped row, e.g. ``session:agent/user/s1``."""
        if self.kind == "user":
            return f"user:{self.agent}/{self.user}"
        if self.kind == "session":
            return f"session:{self.agent}/{self.user}/{self.ref}"
        return f"workflow:{self.agent}/{self.user or '-'}/{self.ref}"

    @classmethod
    def parse(cls, key: str) -> "Scope":
        kind, _, rest = key.partition(":")
        parts = rest.split("/")
        if kind == "user" and len(parts) == 2:
            return cls("user", parts[0], parts[1])
        if kind == "session" and len(parts) == 3:
            return cls("session", parts[0], parts[1], parts[2])
        if kind == "workflow" and len(parts) == 3:
            return cls("workflow", parts[0], None if parts[1] == "-" else parts[1], parts[2])
        raise InvalidInput(f"malformed scope key {key!r}")

    def __str__(self) -> str:
        return self.key


@dataclass(frozen=True)
class EntityKey:
    """What a request addresses: (tenant from the principal) agent, user, and a session or workflow."""

    agent: str
    user: str
    session: str | None = None
    workflow: str | None = None

    def __post_init__(self) -> None:
        check_id(self.agent, "agent id")
        check_id(self.user, "user id")
        if self.session is not None:
            check_id(self.session, "session id")
        if self.workflow is not None:
            check_id(self.workflow, "workflow id")

    def scope(self, kind: ScopeKind) -> Scope:
        if kind == "user":
            return Scope("user", self.agent, self.user)
        if kind == "session":
            if self.session is None:
                raise InvalidInput("this entity key has no session")
            return Scope("session", self.agent, self.user, self.session)
        if self.workflow is None:
            raise InvalidInput("this entity key has no workflow")
        return Scope("workflow", self.agent, self.user, self.workflow)


@dataclass(frozen=True)
class Tenant:
    id: str
    name: str
    created_at: float
    version: int
    #: When its deletion began (``DELETE /v1/tenants/{tenant}``); None: it is not being deleted.
    deleting_since: float | None = None


@dataclass(frozen=True)
class ApiKey:
    id: str
    tenant_id: str
    scopes: frozenset[str]
    label: str
    created_at: float
    revoked_at: float | None
    #: Only set on creation; never stored (the store keeps a hash).
    secret: str | None = field(default=None, repr=False)
    #: The one agent this key may act on (None: every agent of the tenant).
    agent: str | None = None


@dataclass(frozen=True)
class Record:
    """A versioned value in a scope's key-value state."""

    scope: Scope
    key: str
    value: Any
    version: int
    updated_at: float


@dataclass(frozen=True)
class Agent:
    id: str
    name: str
    config: dict[str, Any]
    live_deployment: str | None
    created_at: float
    updated_at: float
    version: int


#: A deployment's ``status``: ``building`` until its template is made, then ``ready``, or ``failed`` (never live);
#: ``deleted`` once deleted (by hand or by ``[agent.retention] keep_deployments``): its number is never used again,
#: it is not listed, and its package is no longer the tenant's.
DEPLOYMENT_BUILDING, DEPLOYMENT_READY, DEPLOYMENT_FAILED = "building", "ready", "failed"
DEPLOYMENT_DELETED = "deleted"


@dataclass(frozen=True)
class Deployment:
    id: str
    agent_id: str
    number: int
    manifest: dict[str, Any]
    package_ref: str
    package_sha256: str
    status: str
    created_at: float
    #: Who builds it while ``building`` (a claim mark: host, process, fleet incarnation); None if not recorded.
    builder: dict[str, Any] | None = None


@dataclass(frozen=True)
class EndUser:
    id: str
    created_at: float
    meta: dict[str, Any]


@dataclass(frozen=True)
class Session:
    id: str
    agent_id: str
    user_id: str
    created_at: float
    last_active: float
    meta: dict[str, Any]
    version: int


@dataclass(frozen=True)
class Event:
    """One entry of the episodic log. ``id`` grows with insertion order."""

    id: int
    scope: Scope
    ts: float
    kind: str
    speaker: str | None
    content: str
    meta: dict[str, Any]

    @property
    def seq(self) -> int:
        return self.id


FACT_TRUST: tuple[str, ...] = ("user_stated", "tool_derived", "model_inferred")
FACT_STATUS: tuple[str, ...] = ("active", "pending", "rejected")


@dataclass(frozen=True)
class Fact:
    """A semantic fact with bi-temporal validity. Superseded facts are closed, never deleted."""

    id: str
    scope: Scope
    subject: str
    attribute: str
    value: str
    text: str
    valid_from: float
    valid_to: float | None
    recorded_at: float
    superseded_at: float | None
    superseded_by: str | None
    trust: str
    status: str
    provenance: tuple[str, ...]
    source: str
    version: int
    #: When a pending fact was confirmed (it was believed from then on, not from ``recorded_at``); None for a fact
    #: that was never pending, one still pending or rejected, and one confirmed before store migration 20.
    confirmed_at: float | None = None


@dataclass(frozen=True)
class WorkflowRun:
    id: str
    scope: Scope
    name: str
    status: str
    input: Any
    state: dict[str, Any]
    current_step: str | None
    result: Any
    error: str | None
    created_at: float
    updated_at: float
    version: int


@dataclass(frozen=True)
class Step:
    run_id: str
    seq: int
    name: str
    status: str
    attempts: int
    result: Any
    error: str | None
    started_at: float
    finished_at: float | None


@dataclass(frozen=True)
class JournalEntry:
    """A side effect keyed by its idempotency key; ``done`` entries are never re-executed."""

    key: str
    run_id: str | None
    step: str | None
    status: str  # pending | done | failed
    result: Any
    error: str | None
    created_at: float
    updated_at: float
    version: int


#: Keys of an instance record's ``meta`` naming templates the fleet's collector keeps while it lives (fleet/gc.py):
#: the one its sandbox was forked from, and the one whose shared directories it binds since a redeploy changed its
#: packages (runtime/instance_update.py).
FORKED_FROM = "template"
SHARED_TEMPLATE = "shared_template"


@dataclass(frozen=True)
class SandboxRecord:
    id: str
    agent_id: str
    scope: Scope
    state: str
    host: str | None
    snapshot_ref: str | None
    disk_ref: str | None
    template_ref: str | None
    last_active: float
    ttl_s: float | None
    meta: dict[str, Any]
    created_at: float
    version: int
    #: Fencing epoch of the host lease: it changes whenever another host takes the instance, and a host's turn
    #: commits check it, so a host that lost the instance (cut off, then back) cannot write it any more.
    lease_epoch: int = 0


@dataclass(frozen=True)
class Span:
    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    start_ts: float
    end_ts: float | None
    status: str
    attrs: dict[str, Any]
    scope: Scope | None = None


@dataclass(frozen=True)
class UsageEntry:
    id: int
    ts: float
    kind: str  # input_tokens | output_tokens | cached_input_tokens | compute_seconds | storage_bytes | cost_usd
    amount: float
    agent_id: str | None
    user_id: str | None
    meta: dict[str, Any]
