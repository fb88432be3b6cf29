"""Detached exec: a command run in an instance's sandbox in the background, answered at once with an execution id.

Its output is kept bounded (the newest ``KEEP_BYTES`` per stream) and followed live; its record lives in the
tenant's ``executions`` table (``input.kind == "exec"``) so a restart shows it ``interrupted``, never running.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Mapping, Sequence

from moorage import clock
from moorage.errors import ConflictError, InvalidInput, NotFound
from moorage.log import get_logger
from moorage.store import Principal, TenantStore
from moorage.store.webhooks import Execution

log = get_logger(__name__)

#: Output kept in memory per stream of a detached exec (older bytes are dropped; ``truncated`` says so).
KEEP_BYTES = 1 << 20
#: Output written to the execution's record per stream when it ends, at most (less where the store's value limit
#: ``max_value_bytes`` is smaller).
RECORD_BYTES = 192 << 10
#: Default and largest timeout of an exec, seconds.
DEFAULT_TIMEOUT_S = 60.0
MAX_TIMEOUT_S = 24 * 3600.0
#: Finished jobs kept in memory (full ``KEEP_BYTES`` output) before only their record remains: at most this many,
#: and at most this many bytes of output in all (the newest first). Bounded by count alone, 200 noisy execs held
#: 400 MiB of a long-running host's memory for good.
KEEP_FINISHED = 200
KEEP_FINISHED_BYTES = 32 << 20
#: A record with no end this long past its deadline was lost with its host: it is shown as interrupted.
LOST_AFTER_S = 30.0
#: Marks the execution record as an exec job; the turn machinery (webhook announcements, orphan resubmission)
#: only looks at records whose ``announced`` is NULL or ``waiting``, so it never touches these.
KIND = "exec"
ID_PREFIX = "exec_"

TERMINAL = ("succeeded", "failed", "timed_out", "cancelled", "interrupted")


class _Stream:
    """One output stream: the newest ``KEEP_BYTES`` bytes, with absolute offsets so followers can resume."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.total = 0

    @property
    def start(self) -> int:
        return self.total - len(self.buf)

    @property
    def truncated(self) -> bool:
        return self.start > 0

    def add(self, chunk: bytes) -> None:
        self.buf += chunk
        self.total += len(chunk)
        if len(self.buf) > KEEP_BYTES:
            del self.buf[: len(self.buf) - KEEP_BYTES]

    def since(self, offset: int) -> tuple[int, bytes]:
        """(offset of the first byte returned, bytes from ``offset`` on; from the oldest kept if it was dropped)."""
        at = max(offset, self.start)
        return at, bytes(self.buf[at - self.start:])


@dataclass
class ExecJob:
    id: str
    tenant_id: str
    sandbox_id: str
    argv: list[str]
    timeout_s: float
    created_at: float
    status: str = "running"
    exit_code: int | None = None
    ended_at: float | None = None
    streams: dict[str, _Stream] = field(default_factory=lambda: {"stdout": _Stream(), "stderr": _Stream()})
    task: "asyncio.Task[None] | None" = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    error: str | None = None
    #: Why the host ended it (``stop_all``, a revoke of its key): recorded as its error.
    stopped_because: str | None = None
    #: The API key that started it: revoking that key cancels it (``runtime/revoked_work.py``).
    key_id: str | None = None

    def _notify(self) -> None:
        old, self.changed = self.changed, asyncio.Event()
        old.set()

    def output(self, stream: str, chunk: bytes) -> None:
        self.streams[stream].add(chunk)
        self._notify()


def _text(data: bytes) -> str:
    return data.decode("utf-8", "replace")


class ExecJobs:
    """The detached execs of one runtime (``ExecJobs.of(runtime)``); the runtime runs each in its sandbox."""

    _instances: "weakref.WeakKeyDictionary[Any, ExecJobs]" = weakref.WeakKeyDictionary()

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self.jobs: dict[str, ExecJob] = {}
        #: Names this process: a record started by another boot of this host and never ended was interrupted.
        self.boot = uuid.uuid4().hex
        self.host = getattr(getattr(runtime, "instances", None), "host", None)

    @classmethod
    def of(cls, runtime: Any) -> "ExecJobs":
        jobs = cls._instances.get(runtime)
        if jobs is None:
            jobs = cls._instances[runtime] = cls(runtime)
        return jobs

    # -- running --------------------------------------------------------------------------------------------

    async def run(self, principal: Principal, sandbox_id: str, argv: Sequence[str], *, timeout_s: float,
                  cwd: str | None = None, env: Mapping[str, str] | None = None) -> dict[str, Any]:
        """Run to the end and answer the result (output capped as the sandbox caps it)."""
        res = await self.runtime.exec(principal, sandbox_id, list(argv), timeout=timeout_s, cwd=cwd, env=env)
        return {"object": "exec_result", "sandbox_id": sandbox_id, "argv": list(argv),
                "status": _status(res.exit_code, res.timed_out), "exit_code": None if res.timed_out else res.exit_code,
                "timed_out": res.timed_out, "stdout": res.stdout_text, "stderr": _text(res.stderr),
                "truncated": res.truncated, "duration_s": res.duration_s}

    async def start(self, principal: Principal, ts: TenantStore, sandbox_id: str, argv: Sequence[str], *,
                    timeout_s: float, cwd: str | None = None, env: Mapping[str, str] | None = None,
                    idempotency_key: str | None = None) -> str:
        """Record the exec and start it in the background; the caller answers 202 with the id at once. The same
        Idempotency-Key (same key, same sandbox) gives the same execution and starts nothing more."""
        principal.require("deploy")
        rec = await asyncio.to_thread(ts.sandboxes.get, sandbox_id)  # 404 for another tenant's sandbox
        if idempotency_key is None:
            exec_id = ID_PREFIX + uuid.uuid4().hex
        else:
            ident = f"{principal.key_id}|{sandbox_id}|{idempotency_key}".encode()
            exec_id = ID_PREFIX + hashlib.sha256(ident).hexdigest()[:32]
        from moorage.runtime.revoked_work import RevokedWork, starting_key

        job = ExecJob(exec_id, ts.tenant_id, sandbox_id, list(argv), timeout_s, time.time(),
                      key_id=starting_key(principal))
        record = {"kind": KIND, "sandbox_id": sandbox_id, "argv": job.argv, "timeout_s": timeout_s,
                  "host": self.host, "boot": self.boot}

        def create() -> bool:
            with ts.transaction():  # never visible to the turn machinery as an unsettled turn
                ex, created = ts.executions.create(job.id, rec.scope.agent, rec.scope.user or "", "", record,
                                                   job.key_id)
                if created:
                    ts.executions.mark_announced(job.id, KIND, expected_version=ex.version)
                return created

        if not await asyncio.to_thread(create):
            return exec_id
        self._prune()
        self.jobs[job.id] = job
        job.task = asyncio.create_task(self._drive(principal, ts, job, cwd, env), name=f"exec-{job.id}")
        RevokedWork.of(self.runtime).watch()  # a revoke of the key that started it cancels it here
        return exec_id

    async def _drive(self, principal: Principal, ts: TenantStore, job: ExecJob, cwd: str | None,
                     env: Mapping[str, str] | None) -> None:
        exit_code: int | None = None
        error: str | None = None
        try:
            res = await self.runtime.exec(principal, job.sandbox_id, job.argv, timeout=job.timeout_s, cwd=cwd,
                                          env=env, on_output=job.output, execution=job.id)
            status = _status(res.exit_code, res.timed_out)
            exit_code = None if res.timed_out else res.exit_code
        except asyncio.CancelledError:
            status = "cancelled"  # leaving sb.exec sent the guest a cancel: it killed the process group
            error = job.stopped_because
        except Exception as e:  # noqa: BLE001 - recorded on the execution; details stay in the log
            log.warning("detached exec failed", execution=job.id, error=str(e))
            status, error = "failed", getattr(e, "message", None) or f"the exec failed ({type(e).__name__})"
        ended = time.time()
        # The end is recorded before anyone sees it: a view from any host (or after a restart) agrees with this one.
        write = asyncio.ensure_future(asyncio.to_thread(self._record_end, ts, job, status, exit_code, error, ended))
        try:
            await asyncio.shield(write)
        except asyncio.CancelledError:
            await write  # a cancel after the command ended changes nothing: finish recording how it ended
        job.status, job.exit_code, job.error, job.ended_at = status, exit_code, error, ended
        job._notify()
        self._prune()

    @staticmethod
    def _record_end(ts: TenantStore, job: ExecJob, status: str, exit_code: int | None, error: str | None,
                    ended: float) -> None:
        # The tail of each stream that fits the store's value limit (halved until the JSON fits).
        keep = min(RECORD_BYTES, max(1024, getattr(ts, "max_value_bytes", RECORD_BYTES) // 2 - 4096))
        while True:
            end = {"status": status, "exit_code": exit_code, "error": error, "ended_at": ended,
                   **{name: _recorded(s, keep) for name, s in job.streams.items()}}
            try:
                ts.executions.add_events(job.id, [{"kind": "exec.ended", "data": end, "at": ended}])
                return
            except InvalidInput:
                if keep == 0:
                    break
                keep //= 4
            except Exception as e:  # noqa: BLE001 - the in-memory job still answers; the record says interrupted later
                log.error("could not record the end of a detached exec", execution=job.id, error=str(e))
                return
        log.error("could not record the end of a detached exec: too large", execution=job.id)

    def _prune(self) -> None:
        done = sorted((j for j in self.jobs.values() if j.status != "running"), key=lambda j: j.ended_at or 0,
                      reverse=True)
        held = 0
        for n, j in enumerate(done):
            held += sum(len(s.buf) for s in j.streams.values())
            if n >= KEEP_FINISHED or held > KEEP_FINISHED_BYTES:
                self.jobs.pop(j.id, None)

    def forget(self, sandbox_ids: set[str]) -> None:
        """Drop the jobs of deleted sandboxes (a forgotten user's): their records are gone, so is their output."""
        for j in [j for j in self.jobs.values() if j.sandbox_id in sandbox_ids]:
            self.jobs.pop(j.id, None)  # one still ending (its sandbox destroyed under it) ends unlisted

    def local(self, ts: TenantStore, execution_id: str) -> ExecJob | None:
        job = self.jobs.get(execution_id)
        return job if job is not None and job.tenant_id == ts.tenant_id else None

    async def cancel(self, ts: TenantStore, ex: Execution) -> dict[str, Any]:
        """Kill a running exec; cancelling one that already ended is a 409."""
        job = self.local(ts, ex.id)
        if job is None or job.status != "running" or job.task is None:
            view = await asyncio.to_thread(self.view, ts, ex)
            if view["status"] == "running":
                raise ConflictError(f"execution {ex.id} runs on another host",
                                    hint=f"cancel it through host {ex.input.get('host')!r}")
            raise ConflictError(f"execution {ex.id} already {view['status']}", hint="nothing is left to cancel")
        job.task.cancel()
        await asyncio.shield(job.task)  # _drive records the cancel and ends normally
        return await asyncio.to_thread(self.view, ts, ex)

    async def stop_all(self, why: str) -> int:
        """End every detached exec this host runs (its clean stop): each is killed in its sandbox and recorded as
        ``cancelled`` with ``why`` and its output so far, so the instances they held sleep at once instead of
        after the shutdown's wait for busy instances. Returns how many were running."""
        running = [j for j in self.jobs.values() if j.status == "running" and j.task is not None and not j.task.done()]
        for job in running:
            job.stopped_because = why
            assert job.task is not None
            job.task.cancel()
        await asyncio.gather(*(asyncio.shield(j.task) for j in running if j.task is not None), return_exceptions=True)
        if running:
            log.info("detached execs ended by the host", count=len(running), why=why)
        return len(running)

    # -- reading --------------------------------------------------------------------------------------------

    def view(self, ts: TenantStore, ex: Execution) -> dict[str, Any]:
        """The execution as callers see it: from the running job here, else from its record."""
        inp = ex.input
        base = {"id": ex.id, "object": "execution", "kind": KIND, "sandbox_id": inp.get("sandbox_id"),
                "agent": ex.agent, "user": ex.user or None, "argv": inp.get("argv"), "timeout_s": inp.get("timeout_s"),
                "created_at": ex.created_at}
        job = self.local(ts, ex.id)
        if job is not None:
            out = {name: {"text": _text(bytes(s.buf)), "bytes": s.total, "truncated": s.truncated}
                   for name, s in job.streams.items()}
            return {**base, "status": job.status, "exit_code": job.exit_code, "error": job.error, **_flat(out),
                    "updated_at": job.ended_at or time.time()}
        end = next((e.get("data") for e in ex.events if e.get("kind") == "exec.ended"), None)
        if isinstance(end, dict):
            out = {name: end.get(name) or {"text": "", "bytes": 0, "truncated": False} for name in ("stdout", "stderr")}
            return {**base, "status": end.get("status"), "exit_code": end.get("exit_code"), "error": end.get("error"),
                    **_flat(out), "updated_at": ex.updated_at}
        empty = {"text": "", "bytes": 0, "truncated": False}
        timeout = float(inp.get("timeout_s") or DEFAULT_TIMEOUT_S)
        lost = (inp.get("host") == self.host and inp.get("boot") != self.boot) or \
            clock.now() > ex.created_at + timeout + LOST_AFTER_S
        if lost:
            return {**base, "status": "interrupted", "exit_code": None,
                    "error": "the host running it stopped before it ended; its output is lost",
                    **_flat({"stdout": empty, "stderr": empty}), "updated_at": ex.updated_at}
        return {**base, "status": "running", "exit_code": None, "error": None,
                **_flat({"stdout": empty, "stderr": empty}), "updated_at": ex.updated_at}

    async def follow(self, ts: TenantStore, ex: Execution) -> AsyncIterator[tuple[str, Any]]:
        """``("output", {...})`` for each piece of output from the oldest kept byte on, then ``("end", view)``."""
        job = self.local(ts, ex.id)
        if job is None:  # ended before this host's start, or runs elsewhere: what the record holds
            view = await asyncio.to_thread(self.view, ts, ex)
            for name in ("stdout", "stderr"):
                if view[name]:
                    yield "output", {"stream": name, "offset": view[f"{name}_bytes"] - len(view[name].encode()),
                                     "text": view[name]}
            yield "end", _without_output(view)
            return
        offsets = {"stdout": 0, "stderr": 0}
        while True:
            changed = job.changed
            for name, s in job.streams.items():
                at, data = s.since(offsets[name])
                if data:
                    offsets[name] = at + len(data)
                    yield "output", {"stream": name, "offset": at, "text": _text(data)}
            if job.status != "running":
                yield "end", _without_output(await asyncio.to_thread(self.view, ts, ex))
                return
            await changed.wait()


def _status(exit_code: int, timed_out: bool) -> str:
    return "timed_out" if timed_out else ("succeeded" if exit_code == 0 else "failed")


def _recorded(s: _Stream, keep: int) -> dict[str, Any]:
    tail = bytes(s.buf[len(s.buf) - min(keep, len(s.buf)):])
    return {"text": _text(tail), "bytes": s.total, "truncated": s.total > len(tail)}


def _flat(out: dict[str, dict[str, Any]]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for name, o in out.items():
        flat[name] = o["text"]
        flat[f"{name}_bytes"] = o["bytes"]
    flat["truncated"] = any(o["truncated"] for o in out.values())
    return flat


def _without_output(view: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in view.items() if k not in ("stdout", "stderr")}


def is_exec(ex: Execution) -> bool:
    return isinstance(ex.input, dict) and ex.input.get("kind") == KIND


def check_timeout(value: Any) -> float:
    if value is None:
        return DEFAULT_TIMEOUT_S
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_TIMEOUT_S:
        raise InvalidInput(f"timeout_s must be a number of seconds in (0, {MAX_TIMEOUT_S:g}]",
                           hint=f"leave it out for the default of {DEFAULT_TIMEOUT_S:g} s")
    return float(value)


def get_exec(ts: TenantStore, principal: Principal, execution_id: str) -> Execution:
    """The exec execution ``execution_id`` of this tenant, visible to ``principal``. One that does not exist, one
    of another agent (a key limited to one agent) and a turn the principal may not see are the same 404, worded
    alike, so none tells that the id exists; a turn the principal may see is a 409 saying how a turn is cancelled."""
    unknown = NotFound(f"no exec execution {execution_id!r}",
                       hint="exec execution ids come from POST /v1/sandboxes/{id}/exec with detach: true")
    try:
        ex = ts.executions.get(execution_id)
    except NotFound:
        raise unknown from None
    visible = principal.user is None and (principal.agent is None or ex.agent == principal.agent)
    if not visible:
        raise unknown
    if not is_exec(ex):
        raise ConflictError(f"execution {execution_id} is a turn, not an exec",
                            hint="a turn is cancelled as its workflow run: POST /v1/workflows/{run_id}/cancel (the "
                                 "run_id is in GET /v1/executions/{id})")
    return ex
