"""Forks of an instance at a checkpoint into new end-users of the same agent: the checks made before anything is
written, the work (a template of the checkpoint's sandbox half, then each new user), and its undo when it fails."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import TYPE_CHECKING, Any, Sequence

from moorage.errors import ConflictError, InvalidInput
from moorage.log import get_logger
from moorage.store import EntityKey, Scope, TenantStore
from moorage.store.model import check_id
from moorage.store.repos.checkpoints import Checkpoint, checkpoints_of
from moorage.timetravel.gate import Gate
from moorage.timetravel.holding import LINE_HOLDER

if TYPE_CHECKING:
    from moorage.timetravel.timeline import TimeTravel

log = get_logger(__name__)

#: At most this many end-users one fork call creates.
MAX_FORKS = 16


async def check_new_users(ts: TenantStore, agent: str, user: str, to_users: Sequence[str]) -> None:
    """Refuse, before anything is written, new users a fork cannot make: too many, repeated, the source, taken."""
    if not to_users or len(to_users) > MAX_FORKS or len(set(to_users)) != len(to_users):
        raise InvalidInput(f"name 1-{MAX_FORKS} distinct new users to fork into")
    for u in to_users:
        check_id(u, "user id")
        if u == user:
            raise InvalidInput("a fork needs another user id", hint="roll back to stay on the same user")
        if await asyncio.to_thread(ts.sandboxes.for_scope, Scope.for_user(agent, u)) is not None:
            raise ConflictError(f"user {u!r} of agent {agent!r} already has an instance",
                                hint="fork into a new user id")



async def fork_through(tt: "TimeTravel", ts: TenantStore, agent: str, user: str, target: Checkpoint, to_users: Sequence[str],
                        template_id: str, started: float) -> dict[str, Any]:
    """``fork``'s work: a template ``template_id`` of the checkpoint's sandbox half, then each new user."""
    from moorage.timetravel.timeline import _can_delete, _key, _what

    rt, repo, template = tt.rt, checkpoints_of(ts), None
    # The source's sandbox is taken to the checkpoint and back: refused while an exec runs in it, and the
    # operator's reads and execs arriving meanwhile wait (a fork without a sandbox half leaves it alone).
    gate = Gate.of(rt).travelling(_key(ts, agent, user), "fork", _what(agent, user)) if target.sandbox_checkpoint \
        else contextlib.nullcontext()
    async with gate, tt._hold(ts, agent, user) as sandbox:
        # Read again now the instance is held: a turn the fork waited for may have pruned it meanwhile.
        target = await asyncio.to_thread(repo.restorable, agent, user, target.id)
        agent_rec, lc, _ = await asyncio.to_thread(rt.router.resolve, ts, EntityKey(agent, user, "default"))
        if target.sandbox_checkpoint:
            await tt._sandbox_half(sandbox, target)
            # The driver makes templates of a sandbox's present state: the source goes to the checkpoint for the
            # template and back. The way back is recorded first, so a killed host returns it on the next call.
            here = f"tt-fork-{uuid.uuid4().hex[:12]}"
            await sandbox.checkpoint(here)
            await asyncio.to_thread(repo.set_pending, agent, user, {"op": "fork-restore", "vm": here})
            try:
                await sandbox.rollback(target.sandbox_checkpoint)
                template = await rt.driver.make_template(sandbox, template_id)
            finally:
                await sandbox.rollback(here)
                rt._loaded.pop(sandbox.id, None)
                await asyncio.to_thread(repo.set_pending, agent, user, None)
                if _can_delete(sandbox):
                    with contextlib.suppress(Exception):
                        await sandbox.delete_checkpoint(here)
    out: list[dict[str, Any]] = []
    # The users this call made so far, with what each was before (a user registered without an instance can
    # be forked into): a fork that fails part way is undone whole, so its retry is not refused as a duplicate.
    made: list[tuple[str, Any]] = []
    try:
        if template is not None and rt.templates.published is not None:
            # A fleet: the template goes to the object store before any fork is made from it, so the forks
            # wake on any host (a micro-VM fork needs its template for life; fleet/templates.py publish_fork).
            try:
                await asyncio.to_thread(rt.templates.published.publish_fork, template,
                                        {"tenant": ts.tenant_id, "agent": agent, "user": user})
            except Exception as e:  # noqa: BLE001 - the forks still work, on this host only
                log.warning("fork template not published; its forks wake only on this host", error=str(e))
        for u in to_users:
            new_scope = Scope.for_user(agent, u)
            # In the new user's line: a first turn for them waits, instead of provisioning from the agent's
            # template before the fork's does.
            async with rt.router._on_instance((ts.tenant_id, new_scope.key), LINE_HOLDER, new_scope, lc,
                                             exclusive=True):
                if await asyncio.to_thread(ts.sandboxes.for_scope, new_scope) is not None:
                    raise ConflictError(f"user {u!r} of agent {agent!r} got an instance meanwhile",
                                        hint="fork into a new user id")
                made.append((u, await asyncio.to_thread(ts.agent_users.find, agent, u)))
                rows = await asyncio.to_thread(repo.copy_to_user, agent, user, target.id, u)
                async with contextlib.AsyncExitStack() as held:
                    sb = None if template is None else await held.enter_async_context(
                        rt.instances.turn(ts, new_scope, template, lifecycle=lc, here=True))
                    first = await tt._take(ts, agent, u, sb, kind="fork",
                                             summary={"forked_from": {"user": user, "checkpoint": target.id}})
            out.append({"user": u, "rows": rows, "checkpoint": first.id, "sandbox_id": sb.id if sb else None})
    except Exception:
        await undo_forks(tt, ts, agent, made)
        raise
    finally:
        if template is not None:
            with contextlib.suppress(Exception):
                await rt.driver.delete_template(template)
    ms = round((time.perf_counter() - started) * 1000, 1)
    log.info("instance forked", agent=agent, user=user, checkpoint=target.id, into=list(to_users), ms=ms)
    return {"object": "fork", "agent": agent, "user": user, "checkpoint": target.id, "forks": out, "ms": ms}

async def undo_forks(tt: "TimeTravel", ts: TenantStore, agent: str, made: Sequence[tuple[str, Any]]) -> None:
    """Remove what a failed fork made of each of its new users (instance, copied rows, checkpoints); a user
    that was registered before gets its registration back as it was."""
    for u, before in made:
        try:
            await tt.rt.forget_in(ts, agent, u)
            await asyncio.to_thread(ts.agent_users.delete, agent, u)
            if before is not None:
                await asyncio.to_thread(ts.agent_users.put, agent, u, meta=before.meta, limits=before.limits)
        except Exception as e:  # noqa: BLE001 - the fork's own error is the one to report
            log.error("could not undo a failed fork's new user; forget it to fork into it again", agent=agent,
                      user=u, error=str(e))
    if made:
        log.warning("fork failed part way; the users it made were removed", agent=agent,
                    users=[u for u, _ in made])
