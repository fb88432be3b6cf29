"""docs/durable.md's "In agent code": every call it lists is the agent's `ctx` (guest/agent_context.py) with the
signature written there, awaited; and what it says an agent's `ctx` lacks (the engine's `state`, `failures`, a
step's `backoff` and `retry_on`) is indeed not there, where the rest of the page's engine example uses them."""

from __future__ import annotations

import ast
import inspect
import re

from moorage.guest.agent_context import AgentContext
from tests.cli.test_docs_commands import ROOT, fenced_blocks

PAGE = ROOT / "docs" / "durable.md"


def _section() -> str:
    return PAGE.read_text().split("## In agent code", 1)[1].split("\n## ", 1)[0]


def _params(sig: str) -> list[str]:
    """The parameters of a call as written ("name, fn, *args, idempotency_key=None"), in a comparable form."""
    call = ast.parse(f"f({sig})", mode="eval").body
    assert isinstance(call, ast.Call)
    out = [("*" + a.value.id) if isinstance(a, ast.Starred) else a.id for a in call.args]  # type: ignore[union-attr]
    out += [("**" + ast.unparse(k.value)) if k.arg is None else f"{k.arg}={ast.unparse(k.value)}" for k in call.keywords]
    return out


def _actual(fn: object) -> list[str]:
    out = []
    for p in list(inspect.signature(fn).parameters.values())[1:]:  # type: ignore[arg-type]
        prefix = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
        out.append(prefix + p.name + ("" if p.default is p.empty else f"={p.default!r}"))
    return out


def test_the_agent_ctx_calls_the_page_lists_are_the_guests() -> None:
    block = next(body for lang, body in fenced_blocks(_section()) if lang == "python")
    calls = re.findall(r"^await ctx\.([a-z_]+)\((.*?)\)\s*(?:#|$)", block, re.M)
    assert {name for name, _ in calls} == {"step", "interrupt", "correct", "history", "checkpoint"}, calls
    for name, sig in calls:
        fn = getattr(AgentContext, name)
        assert inspect.iscoroutinefunction(fn), name
        assert _params(sig) == _actual(fn), (name, sig, _actual(fn))


def test_what_the_page_says_an_agents_ctx_lacks_it_lacks() -> None:
    section = _section()
    assert "no `ctx.state` and no `ctx.failures`" in section and "no `backoff` or `retry_on`" in section
    assert not hasattr(AgentContext, "state") and not hasattr(AgentContext, "failures")
    step = inspect.signature(AgentContext.step).parameters
    assert "backoff" not in step and "retry_on" not in step
    assert "ctx.state[" in PAGE.read_text().split("## In agent code", 1)[1]  # the engine's example, below it, has one
