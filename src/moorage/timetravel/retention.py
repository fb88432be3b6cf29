"""Time travel's rules that need no runtime: the ``[agent.timetravel]`` policy, which checkpoints retention keeps,
the history an instance grew from, and how a checkpoint is shown (and whether it can be restored here)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

from moorage.log import get_logger
from moorage.store.repos.checkpoints import MISSING, Checkpoint

log = get_logger(__name__)


@dataclass(frozen=True)
class Policy:
    """``[agent.timetravel]`` of moorage.toml: automatic checkpoints after each turn, and what retention keeps."""

    #: Taken after the turn's reply went out, while the turn still holds the instance (it delays only a next turn
    #: of the same instance arriving meanwhile). None: the driver's default (``AUTO_DRIVERS``).
    auto: bool | None = None
    #: The newest checkpoints of the current branch kept.
    keep: int = 20
    #: Besides those, the newest checkpoint of each of the last ``daily`` days.
    daily: int = 30
    #: And the newest ``named`` of those the agent's own code named (``ctx.checkpoint``, in a turn): a loop of them
    #: keeps a bounded number, and a bounded share of the host's disk. Named through the API they are all kept.
    named: int = 20

    @classmethod
    def of(cls, manifest: dict[str, Any] | None) -> "Policy":
        raw = (manifest or {}).get("timetravel") or {}
        if not isinstance(raw, dict):
            return cls()
        out = cls()
        try:
            auto = raw.get("auto", out.auto)
            keep = int(raw.get("keep", out.keep))
            daily = int(raw.get("daily", out.daily))
            named = int(raw.get("named", out.named))
        except (TypeError, ValueError):
            log.warning("ignoring a malformed [agent.timetravel] table", table=str(raw)[:200])
            return out
        if auto is not None and not isinstance(auto, bool):
            log.warning("ignoring a malformed [agent.timetravel] auto", auto=str(auto)[:50])
            auto = out.auto
        return cls(auto, max(1, keep), max(0, daily), max(0, named))


def checkpoint_view(ck: Checkpoint, *, current_branch: str | None = None, restorable: bool | None = None,
                    in_history: bool | None = None) -> dict[str, Any]:
    """A checkpoint as the API shows it. ``restorable``: whether a rollback or fork to it can work here (None:
    not known, its sandbox is not on this host). ``in_history``: one of the points the instance's current state
    grew from (``lineage``; on an earlier branch after a rollback), as opposed to an abandoned branch's."""
    d = asdict(ck)
    del d["event_ranges"]  # which event ids the lineage holds: the store's bookkeeping, not the API's
    d["object"] = "checkpoint"
    d["current_branch"] = ck.branch == current_branch
    d["in_history"] = (ck.branch == current_branch) if in_history is None else in_history
    d["restorable"] = restorable
    return d


def restorable(ck: Checkpoint, sandbox_id: str | None, halves: dict[str, int] | None) -> bool | None:
    """Whether ``ck`` can be rolled back to or forked, given the checkpoints its instance's sandbox ``sandbox_id``
    holds on this host (``halves``, name to bytes; None: not known here). Not: a failed one, one taken of a sandbox
    the instance has left, one whose sandbox half was never written (the host stopped or the disk failed while it
    was written behind its turn)."""
    if ck.kind == MISSING:
        return False
    if not ck.sandbox_checkpoint:
        return True
    if halves is None:
        return None
    return ck.sandbox_id == sandbox_id and ck.sandbox_checkpoint in halves


def lineage(cks: Sequence[Checkpoint], head_id: str | None) -> list[Checkpoint]:
    """The instance's history as it is now, newest first: the head checkpoint and its parents, across the branches
    it grew from (after a rollback to checkpoint 3 and two turns: those two, then 3, 2, 1)."""
    by_id, out = {c.id: c for c in cks}, []
    c = by_id.get(head_id) if head_id else None
    while c is not None and len(out) < len(by_id):
        out.append(c)
        c = by_id.get(c.parent_id) if c.parent_id else None
    return out


def by_agent(ck: Checkpoint) -> bool:
    """Whether the agent's code took ``ck`` (``ctx.checkpoint`` during a turn), not a person through the API."""
    return bool(ck.summary.get("during_turn"))


def to_keep(cks: Sequence[Checkpoint], branch: str | None, head_id: str | None, policy: Policy, now: float) -> set[str]:
    """Ids retention keeps: the newest ``keep`` of the instance's current history (``lineage``: the points a
    rollback after the last one grew from included), the newest of each of the last ``daily`` days, every one
    named through the API and the newest ``named`` the agent's code named, and the tip of every other branch (an
    abandoned branch stays restorable)."""
    # A missing one (a failed automatic checkpoint of the current branch: it moves no head, so no lineage has it)
    # counts in the newest ``keep`` like the turn it stands for, and is never a branch's tip or a day's checkpoint.
    history = lineage(cks, head_id) + [c for c in cks if c.kind == MISSING and c.branch == branch]
    keep = {c.id for c in sorted(history, key=lambda c: -c.seq)[: policy.keep]}
    newest_first = sorted((c for c in cks if c.kind != MISSING), key=lambda c: -c.seq)
    keep |= {c.id for c in newest_first if c.name and not by_agent(c)}
    keep |= {c.id for c in [c for c in newest_first if c.name and by_agent(c)][: policy.named]}
    tips: dict[str, str] = {}
    days: dict[int, str] = {}
    for c in newest_first:
        tips.setdefault(c.branch, c.id)
        day = int(c.created_at // 86400)
        if now - c.created_at <= policy.daily * 86400:
            days.setdefault(day, c.id)
    return keep | set(tips.values()) | set(days.values())
