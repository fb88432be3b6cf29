"""The operator's reads and execs on an instance's sandbox (``list_files``, ``read_file``, ``exec``, detached execs)
against its rollbacks and forks, on one host.

A read or exec that arrives while a rollback or fork of the instance is requested or runs waits for it, then sees
the instance where it left it (never the abandoned branch mid-rollback, never a sandbox being restored). A
rollback, or a fork that takes the source's sandbox to its checkpoint and back, waits for the reads in flight
(short) but is refused (409 ``exec-running``) while an exec runs on the instance: an exec may run for up to 24 h,
and rolling the sandbox back under it would kill it (micro-VM) or leave it writing into the restored files
(process driver). The refusal names the exec and how to end it. See docs/timetravel.md, "Reads and execs".
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Sequence

from moorage.errors import ConflictError

Key = tuple[str, str]  # (tenant id, the instance's scope key)


class ExecRunning(ConflictError):
    """A rollback or fork was asked for while an exec runs in the instance's sandbox."""

    code = "exec-running"
    http_status = 409


@dataclass
class _Exec:
    argv: list[str]
    started: float
    timeout_s: float | None
    execution: str | None  # a detached exec's execution id


@dataclass
class _State:
    execs: dict[int, _Exec] = field(default_factory=dict)
    readers: int = 0
    read_done: asyncio.Event = field(default_factory=asyncio.Event)
    travels: int = 0
    travel_done: asyncio.Event = field(default_factory=asyncio.Event)

    def idle(self) -> bool:
        return not self.execs and not self.readers and not self.travels


def _argv(argv: Sequence[str]) -> str:
    text = " ".join(argv)
    return text if len(text) <= 80 else text[:77] + "..."


class Gate:
    """One runtime's gate (``Gate.of(runtime)``): per instance, the reads and execs in flight and the rollbacks and
    forks requested. Everything here runs on the runtime's event loop: a check and its registration are one step."""

    _of: "weakref.WeakKeyDictionary[Any, Gate]" = weakref.WeakKeyDictionary()

    def __init__(self) -> None:
        self._states: dict[Key, _State] = {}
        self._ids = itertools.count()

    @classmethod
    def of(cls, runtime: Any) -> "Gate":
        gate = cls._of.get(runtime)
        if gate is None:
            gate = cls._of[runtime] = cls()
        return gate

    def _state(self, key: Key) -> _State:
        st = self._states.get(key)
        if st is None:
            st = self._states[key] = _State()
        return st

    def _drop_if_idle(self, key: Key) -> None:
        st = self._states.get(key)
        if st is not None and st.idle():
            self._states.pop(key, None)

    async def _after_travels(self, key: Key) -> _State:
        """The instance's state once no rollback or fork of it is requested (waited for if one is)."""
        while True:
            st = self._state(key)
            if not st.travels:
                return st
            await st.travel_done.wait()

    @contextlib.asynccontextmanager
    async def reading(self, key: Key) -> AsyncIterator[None]:
        """A read of the sandbox's files: after a rollback or fork in progress; one requested meanwhile waits."""
        st = await self._after_travels(key)
        st.readers += 1
        st.read_done.clear()
        try:
            yield
        finally:
            st.readers -= 1
            if not st.readers:
                st.read_done.set()
            self._drop_if_idle(key)

    @contextlib.asynccontextmanager
    async def executing(self, key: Key, argv: Sequence[str], timeout_s: float | None,
                        execution: str | None = None) -> AsyncIterator[None]:
        """An exec: after a rollback or fork in progress; one requested while it runs is refused (``ExecRunning``)."""
        st = await self._after_travels(key)
        token = next(self._ids)
        st.execs[token] = _Exec(list(argv), time.time(), timeout_s, execution)
        try:
            yield
        finally:
            st.execs.pop(token, None)
            self._drop_if_idle(key)

    def refuse_if_executing(self, key: Key, verb: str, what: str) -> None:
        """``ExecRunning`` if an exec runs in the instance's sandbox (``verb``: "roll back", "fork"; ``what``: the
        instance, for the message)."""
        st = self._states.get(key)
        if st is None or not st.execs:
            return
        ex = min(st.execs.values(), key=lambda e: e.started)
        more = f" (and {len(st.execs) - 1} more)" if len(st.execs) > 1 else ""
        since = time.strftime("%H:%M:%S UTC", time.gmtime(ex.started))
        if ex.execution is not None:
            running = f"detached exec {ex.execution} ({_argv(ex.argv)!r}, running since {since}){more}"
            hint = (f"cancel it (POST /v1/executions/{ex.execution}/cancel) or wait for it to end, then {verb} "
                    "again")
        else:
            ends = "" if ex.timeout_s is None else \
                f", its timeout at {time.strftime('%H:%M:%S UTC', time.gmtime(ex.started + ex.timeout_s))}"
            running = f"exec {_argv(ex.argv)!r} (running since {since}){more}"
            hint = (f"wait for it to end{ends}, or end the request that runs it (a long command is better run "
                    f"detached: it can be cancelled with POST /v1/executions/{{id}}/cancel), then {verb} again")
        raise ExecRunning(f"cannot {verb} {what} while an exec runs in its sandbox: {running}; the sandbox would be "
                          "restored under it", hint=hint)

    @contextlib.asynccontextmanager
    async def travelling(self, key: Key, verb: str, what: str) -> AsyncIterator[None]:
        """A rollback or fork: refused while an exec runs; reads and execs arriving from now on wait for it; the
        reads in flight end first."""
        self.refuse_if_executing(key, verb, what)
        st = self._state(key)
        st.travels += 1
        st.travel_done.clear()
        try:
            while st.readers:
                await st.read_done.wait()
            yield
        finally:
            st.travels -= 1
            if not st.travels:
                st.travel_done.set()
            self._drop_if_idle(key)
