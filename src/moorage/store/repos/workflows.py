"""Workflow runs with their checkpointed state (compare-and-set on the version) and the log of their
step attempts."""

from __future__ import annotations

from typing import Any, Sequence

from moorage.errors import ConflictError, InvalidInput, NotFound
from moorage.store.model import Scope, Step, WorkflowRun, check_id
from moorage.store.repos.common import _check_version, _new_id, _now, _Repo
from moorage.store.sql import loads


_RUN_COLS = "id, scope, name, status, input, state, current_step, result, error, created_at, updated_at, version"
RUN_STATUSES = ("pending", "running", "waiting", "succeeded", "failed", "cancelled")
#: The kinds of scope a run may have (``Scope.key``'s prefixes).
_SCOPE_KINDS = ("user", "session", "workflow")


def _run(r: tuple) -> WorkflowRun:
    return WorkflowRun(r[0], Scope.parse(r[1]), r[2], r[3], loads(r[4]), loads(r[5]), r[6], loads(r[7]), r[8], r[9], r[10], r[11])


_STEP_COLS = "run_id, seq, name, status, attempts, result, error, started_at, finished_at"


def _step(r: tuple) -> Step:
    return Step(r[0], r[1], r[2], r[3], r[4], loads(r[5]), r[6], r[7], r[8])


class WorkflowRuns(_Repo):
    """Workflow runs with checkpointed state, and their step log."""

    def create(self, scope: Scope, name: str, input: Any = None, *, run_id: str | None = None) -> WorkflowRun:
        run_id = run_id or (scope.ref if scope.kind == "workflow" else None) or _new_id()
        check_id(run_id, "run id")
        check_id(name, "workflow name")
        now = _now()
        run = WorkflowRun(run_id, scope, name, "pending", input, {}, None, None, None, now, now, 1)
        with self._ts._tx() as c:
            n = c.x(
                f"INSERT INTO workflow_runs ({_RUN_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                (run_id, scope.key, name, "pending", self._json(input, "workflow input"), "{}", None, None, None, now, now, 1),
            )
            if n != 1:
                raise ConflictError(f"workflow run {run_id!r} already exists", current_version=None)
            self._ts._touch(c, scope, now)
        return run

    def get(self, run_id: str) -> WorkflowRun:
        with self._ts._tx(write=False) as c:
            r = c.one(f"SELECT {_RUN_COLS} FROM workflow_runs WHERE id = ?", (run_id,))
        if r is None:
            raise NotFound(f"no workflow run {run_id!r}")
        return _run(r)

    def list(self, *, status: Sequence[str] | None = None, scope: Scope | None = None, agent: str | None = None,
             user: str | None = None, after: tuple[float, str] | None = None, limit: int = 100) -> list[WorkflowRun]:
        """Runs by last change, oldest first (then by id); ``after``: only those past that (updated_at, id), the
        position of the last run of a page. ``agent``: only that agent's runs (every kind of scope it has);
        ``user`` (with ``agent``): only that end-user's (a turn's run is in a workflow scope naming its user)."""
        where, params = "1 = 1", []
        if status:
            where += f" AND status IN ({','.join('?' * len(status))})"
            params += list(status)
        if scope is not None:
            where += " AND scope = ?"
            params.append(scope.key)
        if user is not None and agent is None:
            raise ValueError("runs.list: user needs agent")
        if agent is not None:
            # A scope key is ``kind:agent/...`` and neither an agent nor a user id holds a "/": a range per kind (the
            # user's own: ``session:``/``workflow:agent/user/...``, and ``user:agent/user`` itself), which the scope
            # index answers ("0" is the character after "/").
            ranges = []
            for kind in _SCOPE_KINDS:
                if user is not None and kind == "user":
                    ranges.append("scope = ?")
                    params.append(Scope.for_user(agent, user).key)
                    continue
                head = f"{kind}:{agent}/" + ("" if user is None else f"{user}/")
                ranges.append("(scope >= ? AND scope < ?)")
                params += [head, head[:-1] + "0"]
            where += " AND (" + " OR ".join(ranges) + ")"
        if after is not None:
            # As a row value, so the (updated_at, id) index seeks to it (an OR of the two read from the start).
            where += " AND (updated_at, id) > (?, ?)"
            params += [after[0], after[1]]
        with self._ts._tx(write=False) as c:
            return [_run(r) for r in c.q(f"SELECT {_RUN_COLS} FROM workflow_runs WHERE {where} ORDER BY updated_at, id "
                                         "LIMIT ?", (*params, limit))]

    _UNSET: Any = object()

    def update(
        self, run_id: str, *, expected_version: int, status: str | None = None, state: dict[str, Any] | None = None,
        current_step: Any = _UNSET, result: Any = _UNSET, error: Any = _UNSET,
    ) -> WorkflowRun:
        _check_version(expected_version)
        if status is not None and status not in RUN_STATUSES:
            raise InvalidInput(f"unknown run status {status!r}", hint=f"one of {', '.join(RUN_STATUSES)}")
        with self._ts._tx() as c:
            cur = c.one(f"SELECT {_RUN_COLS} FROM workflow_runs WHERE id = ?", (run_id,))
            if cur is None:
                raise NotFound(f"no workflow run {run_id!r}")
            r = _run(cur)
            now = _now()
            new = WorkflowRun(
                r.id, r.scope, r.name, r.status if status is None else status, r.input, r.state if state is None else state,
                r.current_step if current_step is self._UNSET else current_step, r.result if result is self._UNSET else result,
                r.error if error is self._UNSET else error, r.created_at, now, expected_version + 1,
            )
            n = c.x(
                "UPDATE workflow_runs SET status = ?, state = ?, current_step = ?, result = ?, error = ?, updated_at = ?, "
                "version = version + 1 WHERE id = ? AND version = ?",
                (new.status, self._json(new.state, "workflow state"), new.current_step,
                 None if new.result is None else self._json(new.result, "workflow result"), new.error, now, run_id, expected_version),
            )
            if n != 1:
                raise ConflictError(f"workflow run {run_id} changed (now version {r.version})", current_version=r.version)
        return new

    def record_step(
        self, run_id: str, seq: int, name: str, status: str, *, attempts: int = 1, result: Any = None,
        error: str | None = None, started_at: float | None = None, finished_at: float | None = None,
    ) -> Step:
        """Insert or replace the log entry of one step attempt (the log of attempts, failures and corrections)."""
        now = _now()
        st = Step(run_id, seq, name, status, attempts, result, error, started_at or now, finished_at)
        with self._ts._tx() as c:
            if not c.one("SELECT 1 FROM workflow_runs WHERE id = ?", (run_id,)):
                raise NotFound(f"no workflow run {run_id!r}")
            c.x("DELETE FROM steps WHERE run_id = ? AND seq = ?", (run_id, seq))
            c.x(
                f"INSERT INTO steps ({_STEP_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (run_id, seq, name, status, attempts, None if result is None else self._json(result, "step result"),
                 error, st.started_at, finished_at),
            )
        return st

    def steps(self, run_id: str) -> list[Step]:
        with self._ts._tx(write=False) as c:
            return [_step(r) for r in c.q(f"SELECT {_STEP_COLS} FROM steps WHERE run_id = ? ORDER BY seq", (run_id,))]
