"""The memory counter agent the online backup's tests and benchmark deploy (tests/cli/test_online_backup.py,
bench/lifecycle/online_backup.py): each turn counts in the user's memory and in their files, so a copy whose store
and files are from different moments disagrees on the count."""

from __future__ import annotations

from pathlib import Path

#: Each turn remembers ``turn N``, then writes N into ``counter.txt``, and replies ``N: message``. A message
#: ``slow`` takes 25 s, ``slow8`` 8 s (any number after ``slow``), between the two writes.
AGENT_PY = '''
import asyncio

async def on_message(ctx, message):
    try:
        n = int(ctx.files.read("counter.txt"))
    except Exception:
        n = 0
    await ctx.memory.remember(f"turn {n + 1}")
    if message.startswith("slow"):  # "slow" runs 25 s, "slow8" 8 s
        await asyncio.sleep(float(message[4:] or 25))
    ctx.files.write("counter.txt", str(n + 1))
    return f"{n + 1}: {message}"
'''


def write_counter_agent(base: Path, *, toml: str = "") -> Path:
    """``base/counter``: the agent ``counter`` (``users = "auto"``) ready to deploy; ``toml`` is appended to its
    moorage.toml (more sections, e.g. ``[agent.timetravel]``)."""
    agent = base / "counter"
    agent.mkdir(parents=True)
    (agent / "moorage.toml").write_text('[agent]\nname = "counter"\nentry = "agent.py"\n'
                                        '[agent.lifecycle]\nusers = "auto"\n' + toml)
    (agent / "agent.py").write_text(AGENT_PY)
    return agent

