"""What the host serves to a LangGraph checkpointer inside a sandbox: its checkpoints and pending writes, kept
as state records of the turn's own end-user (``langgraph/…`` keys of the user scope).

The guest serialises; the host stores opaque blobs and never imports LangGraph. The user comes from the turn the
host started (``TurnBinding``), never from the call, and being state records of that user the graph's
checkpoints are covered by time travel (rollback, fork), forgetting and zero retention like the rest of its rows.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import json
import re
from typing import TYPE_CHECKING, Any, Awaitable, Callable
from urllib.parse import quote

from moorage.errors import ConflictError, InvalidInput
from moorage.store import Scope, TenantStore

if TYPE_CHECKING:
    from moorage.runtime.host_calls import TurnBinding

PREFIX = "langgraph/"
#: Checkpoints kept per thread and namespace, newest first; older ones go with their pending writes. Bounded
#: because every checkpoint of the instance lists each of its rows (docs/langgraph.md); moorage's own
#: checkpoints keep older graph states anyway.
HISTORY = 50
#: At most this much checkpoint data (base64 text) in one ``graph.list`` answer; the guest pages for more.
LIST_BYTES = 4 << 20
_MAX_THREAD = 100
_CHECKPOINT_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
_CAS_TRIES = 8


def _text(p: dict[str, Any], name: str, *, empty: bool = False) -> str:
    v = p.get(name)
    if v is None and empty:
        return ""
    if not isinstance(v, str) or (not v and not empty) or "\x00" in v:
        raise InvalidInput(f"graph call needs {name} as a string", hint="this is a bug in the guest checkpointer")
    return v


def _thread_key(p: dict[str, Any]) -> str:
    thread = _text(p, "thread")
    if len(thread) > _MAX_THREAD:
        raise InvalidInput(f"a LangGraph thread_id is at most {_MAX_THREAD} characters",
                           hint="use a shorter thread_id (the user is already bound by moorage)")
    return PREFIX + quote(thread, safe="") + "/"


def _ns_key(p: dict[str, Any]) -> str:
    """The thread's and namespace's key prefix; a namespace (subgraph path) is hashed to keep keys short."""
    ns = _text(p, "ns", empty=True)
    return _thread_key(p) + ("-" if not ns else "n" + hashlib.sha256(ns.encode()).hexdigest()[:20]) + "/"


def _checkpoint_id(v: Any) -> str:
    if not isinstance(v, str) or not _CHECKPOINT_ID.match(v):
        raise InvalidInput("a LangGraph checkpoint id is 1-64 letters, digits and ._:-",
                           hint="this is a bug in the guest checkpointer")
    return v


def _blob(v: Any, what: str) -> dict[str, str]:
    """A serialised value as the guest sent it: {"type": serde type, "data": base64}; checked, kept as text."""
    if not isinstance(v, dict) or not isinstance(v.get("type"), str) or not isinstance(v.get("data"), str):
        raise InvalidInput(f"{what} must be {{type, data}}", hint="this is a bug in the guest checkpointer")
    try:
        base64.b64decode(v["data"], validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInput(f"{what} is not base64", hint="this is a bug in the guest checkpointer") from None
    return {"type": v["type"][:64], "data": v["data"]}


def _task_key(task_id: str) -> str:
    return hashlib.sha256(task_id.encode()).hexdigest()[:16]


class GraphRows:
    """One end-user's graph checkpoints in its user scope: rows ``<ns>c/<id>`` (a checkpoint), ``<ns>w/<id>/<task>``
    (one task's pending writes on it) and ``<ns>index`` (the ids kept, oldest first)."""

    def __init__(self, ts: TenantStore, scope: Scope) -> None:
        self.ts = ts
        self.scope = scope

    def _index(self, ns_key: str) -> tuple[list[str], int]:
        rec = self.ts.state.get(self.scope, ns_key + "index")
        return (list(rec.value.get("ids") or []), rec.version) if rec is not None else ([], 0)

    def put(self, ns_key: str, row: dict[str, Any]) -> None:
        cid = row["id"]
        key = ns_key + "c/" + cid
        existing = self.ts.state.get(self.scope, key)
        self.ts.state.put(self.scope, key, row, expected_version=existing.version if existing else 0)
        for _ in range(_CAS_TRIES):
            ids, version = self._index(ns_key)
            kept = [i for i in ids if i != cid] + [cid]
            dropped, kept = kept[:-HISTORY], kept[-HISTORY:]
            try:
                self.ts.state.put(self.scope, ns_key + "index", {"ids": kept}, expected_version=version)
            except ConflictError:
                continue
            for old in dropped:
                self._drop(ns_key, old)
            return
        raise ConflictError("the graph's checkpoint index kept changing", hint="retry the graph step")

    def _drop(self, ns_key: str, cid: str) -> None:
        for rec in self.ts.state.list(self.scope, prefix=f"{ns_key}w/{cid}/", limit=10_000):
            self._delete(rec.key, rec.version)
        rec = self.ts.state.get(self.scope, ns_key + "c/" + cid)
        if rec is not None:
            self._delete(rec.key, rec.version)

    def _delete(self, key: str, version: int) -> None:
        try:
            self.ts.state.delete(self.scope, key, expected_version=version)
        except ConflictError:
            pass  # changed or gone meanwhile: a later prune takes it

    def put_writes(self, ns_key: str, cid: str, task_id: str, task_path: str, writes: list[list[Any]]) -> None:
        """Merge one task's writes: a write at a non-negative index is kept as first written (a replayed task
        writes the same), a special one (negative index: error, interrupt, resume) replaces the earlier."""
        key = f"{ns_key}w/{cid}/{_task_key(task_id)}"
        for _ in range(_CAS_TRIES):
            rec = self.ts.state.get(self.scope, key)
            have: dict[str, Any] = dict(rec.value.get("writes") or {}) if rec is not None else {}
            for idx, channel, blob in writes:
                if idx >= 0 and str(idx) in have:
                    continue
                have[str(idx)] = [channel, blob]
            value = {"task_id": task_id, "task_path": task_path, "writes": have}
            try:
                self.ts.state.put(self.scope, key, value, expected_version=rec.version if rec else 0)
                return
            except ConflictError:
                continue
        raise ConflictError("the graph's pending writes kept changing", hint="retry the graph step")

    def writes(self, ns_key: str, cid: str) -> list[dict[str, Any]]:
        """The checkpoint's pending writes in the order LangGraph applies them: task path, task id, index."""
        out = []
        for rec in self.ts.state.list(self.scope, prefix=f"{ns_key}w/{cid}/", limit=10_000):
            v = rec.value
            for idx, (channel, blob) in v["writes"].items():
                out.append({"task_id": v["task_id"], "task_path": v.get("task_path") or "", "idx": int(idx),
                            "channel": channel, "value": blob})
        out.sort(key=lambda w: (w["task_path"], w["task_id"], w["idx"]))
        return out

    def get(self, ns_key: str, cid: str | None) -> dict[str, Any] | None:
        if cid is None:
            ids, _ = self._index(ns_key)
            if not ids:
                return None
            cid = ids[-1]
        rec = self.ts.state.get(self.scope, ns_key + "c/" + cid)
        return None if rec is None else {**rec.value, "writes": self.writes(ns_key, cid)}

    def list(self, ns_key: str, before: str | None, limit: int) -> tuple[list[dict[str, Any]], bool]:
        """Newest first, older than ``before`` when given; stops at ``limit`` rows or ``LIST_BYTES`` of data."""
        ids, _ = self._index(ns_key)
        ids.reverse()
        if before is not None:
            ids = ids[ids.index(before) + 1:] if before in ids else [i for i in ids if i < before]
        out, size = [], 0
        for cid in ids:
            if len(out) >= limit or (out and size >= LIST_BYTES):
                return out, True
            row = self.get(ns_key, cid)
            if row is None:
                continue
            size += len(json.dumps(row))
            out.append(row)
        return out, False

    def delete_thread(self, thread_key: str) -> int:
        n = 0
        while True:
            recs = self.ts.state.list(self.scope, prefix=thread_key, limit=500)
            if not recs:
                return n
            for rec in recs:
                self._delete(rec.key, rec.version)
                n += 1


class GraphCalls:
    """``graph.*`` host calls: the store behind ``moorage.guest.langgraph_saver.MoorageCheckpointer``."""

    def methods(self) -> dict[str, Callable[["TurnBinding", dict[str, Any]], Awaitable[Any]]]:
        return {"graph.put": self.put, "graph.put_writes": self.put_writes, "graph.get": self.get,
                "graph.list": self.list, "graph.delete_thread": self.delete_thread}

    @staticmethod
    def _rows(b: "TurnBinding") -> GraphRows:
        return GraphRows(b.ts, b.user_scope)

    async def put(self, b: "TurnBinding", p: dict[str, Any]) -> dict[str, Any]:
        ns_key = _ns_key(p)
        parent = p.get("parent_id")
        row = {"id": _checkpoint_id(p.get("checkpoint_id")), "thread": _text(p, "thread"),
               "ns": _text(p, "ns", empty=True), "parent_id": None if parent is None else _checkpoint_id(parent),
               "checkpoint": _blob(p.get("checkpoint"), "checkpoint"), "metadata": _blob(p.get("metadata"), "metadata")}
        # A checkpoint over the store's value limit fails as InvalidInput, whose hint says to keep large data
        # in files: the graph's state should hold their names.
        await asyncio.to_thread(self._rows(b).put, ns_key, row)
        return {}

    async def put_writes(self, b: "TurnBinding", p: dict[str, Any]) -> dict[str, Any]:
        ns_key = _ns_key(p)
        raw = p.get("writes")
        if not isinstance(raw, list):
            raise InvalidInput("graph.put_writes needs writes as a list")
        writes = []
        for w in raw:
            if not (isinstance(w, list) and len(w) == 3 and isinstance(w[0], int) and isinstance(w[1], str)):
                raise InvalidInput("each write is [index, channel, value]")
            writes.append([w[0], w[1], _blob(w[2], "a write")])
        await asyncio.to_thread(self._rows(b).put_writes, ns_key, _checkpoint_id(p.get("checkpoint_id")),
                                _text(p, "task_id"), _text(p, "task_path", empty=True), writes)
        return {}

    async def get(self, b: "TurnBinding", p: dict[str, Any]) -> dict[str, Any]:
        ns_key = _ns_key(p)
        cid = p.get("checkpoint_id")
        row = await asyncio.to_thread(self._rows(b).get, ns_key, None if cid is None else _checkpoint_id(cid))
        return {"checkpoint": row}

    async def list(self, b: "TurnBinding", p: dict[str, Any]) -> dict[str, Any]:
        ns_key = _ns_key(p)
        before = p.get("before")
        limit = p.get("limit") or HISTORY
        if not isinstance(limit, int):
            raise InvalidInput("graph.list needs limit as an integer")
        limit = max(1, min(limit, HISTORY))
        rows, more = await asyncio.to_thread(self._rows(b).list, ns_key,
                                             None if before is None else _checkpoint_id(before), limit)
        return {"checkpoints": rows, "more": more}

    async def delete_thread(self, b: "TurnBinding", p: dict[str, Any]) -> dict[str, Any]:
        return {"deleted": await asyncio.to_thread(self._rows(b).delete_thread, _thread_key(p))}
