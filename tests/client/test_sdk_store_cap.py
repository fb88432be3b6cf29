"""A user's ``store_mib`` cap, the documented way: ``[agent.limits] store_mib`` in the agent's moorage.toml, a user's
own limit through the SDK, the standing in ``usage(agent=, user=)["caps"]``; through `moorage up` (process driver).

The agent's calls that hand the store something to keep are refused past the cap with a host error the agent can
read (``store-cap-exceeded``); its turns still run and read, the next turn is refused too while nothing was freed,
and raising the cap gives room at once. Before the cap, a loop of ``ctx.memory.remember`` across turns grew one
user's store without bound (each turn's own bound is 256 MiB)."""

from __future__ import annotations

import re
from pathlib import Path

from typer.testing import CliRunner

from moorage import Client
from moorage.cli.main import app
from moorage.devservices.fleet import LocalHost

AGENT = '''
async def on_message(ctx, message):
    kept, refused = 0, "none"
    for i in range(int(message)):
        try:
            await ctx.memory.remember(("%d " % i) + "x" * 100_000)
            kept += 1
        except ctx.HostError as e:
            refused = "%s: %s" % (e.kind, e)
            break
    hits = await ctx.memory.recall("x", k=1)  # reads go on at the cap
    return "%d kept; %d found; %s" % (kept, len(hits), refused)
'''


def _agent(root: Path, limits: str = "[agent.limits]\nstore_mib = 1\n") -> Path:
    """The hoarding agent, its ``limits`` table as given (the agent's store_mib of 1 MiB unless told)."""
    root.mkdir()
    (root / "moorage.toml").write_text('[agent]\nname = "hoard"\nentry = "agent.py"\n'
                                       f'{limits}[agent.lifecycle]\nusers = "auto"\n')
    (root / "agent.py").write_text(AGENT)
    return root


def _kept(reply: str) -> tuple[int, str]:
    kept, _, rest = reply.partition(" kept; ")
    return int(kept), rest


def test_a_users_store_stops_at_store_mib_and_raising_it_gives_room(tmp_path: Path) -> None:
    host = LocalHost("up", tmp_path / "data", {"MOORAGE_LOG_LEVEL": "warning"}, start_timeout_s=120)
    try:
        with Client(host.url, host.key) as sdk:
            sdk.deploy("hoard", _agent(tmp_path / "hoard"))
            # The agent's 1 MiB: ten 100 kB memories fit, the eleventh does not.
            n, rest = _kept(sdk.invoke("hoard", "30", user="ada")["reply"])
            assert 9 <= n <= 10 and rest.startswith("1 found; store-cap-exceeded: user 'ada' of agent 'hoard' "
                                                    "keeps "), rest
            assert "store_mib cap is 1; memory.append refused" in rest, rest
            assert "storage" not in sdk.usage()  # no tenant ceiling (tenant_max_storage_mib): the tenant not measured
            cap = sdk.usage(agent="hoard", user="ada")["caps"]["store_mib"]
            assert cap["limit"] == 1 and cap["resets_at"] is None and 0.9 < cap["used"] <= 1.0, cap
            shown = CliRunner().invoke(app, ["usage", "--agent", "hoard", "--user", "ada"],
                                       env={"MOORAGE_API_URL": host.url, "MOORAGE_API_KEY": host.key})
            assert shown.exit_code == 0 and re.search(r"cap store_mib[\s│]+0\.9\d* of 1\b", shown.stdout), shown.output
            # Nothing was freed: the next turn runs and reads, and keeps nothing.
            again, rest = _kept(sdk.invoke("hoard", "5", user="ada")["reply"])
            assert again == 0 and rest.startswith("1 found; store-cap-exceeded"), rest
            # A user's own limit overrides the agent's: ada gets a second MiB, bob half of one.
            sdk.put_user("hoard", "ada", limits={"store_mib": 2})
            more, rest = _kept(sdk.invoke("hoard", "30", user="ada")["reply"])
            assert 9 <= more <= 10 and "store_mib cap is 2;" in rest, rest
            assert 1.9 < sdk.usage(agent="hoard", user="ada")["caps"]["store_mib"]["used"] <= 2.0
            sdk.put_user("hoard", "bob", limits={"store_mib": 0.5})
            bob, rest = _kept(sdk.invoke("hoard", "30", user="bob")["reply"])
            assert 4 <= bob <= 5 and "user 'bob'" in rest and "store_mib cap is 0.5;" in rest, rest
            # Forgetting ada frees her store: she starts again from nothing under her agent's cap.
            sdk.delete_user("hoard", "ada")
            fresh, rest = _kept(sdk.invoke("hoard", "30", user="ada")["reply"])
            assert 9 <= fresh <= 10 and "store_mib cap is 1;" in rest, rest
    finally:
        host.stop()


def test_the_operators_ceiling_bounds_every_user_whatever_the_agent_says(tmp_path: Path) -> None:
    # `user_max_store_mib` in the host's settings (here MOORAGE_USER_MAX_STORE_MIB): a tenant's users with no cap,
    # or with a higher one, are held to it; a lower one of the user's still applies.
    host = LocalHost("up", tmp_path / "data", {"MOORAGE_LOG_LEVEL": "warning", "MOORAGE_USER_MAX_STORE_MIB": "0.5"},
                     start_timeout_s=120)
    try:
        with Client(host.url, host.key) as sdk:
            sdk.deploy("hoard", _agent(tmp_path / "hoard"))  # store_mib = 1: over the ceiling
            n, rest = _kept(sdk.invoke("hoard", "30", user="ada")["reply"])
            assert 4 <= n <= 5 and "store_mib cap is 0.5;" in rest, rest
            sdk.put_user("hoard", "bob", limits={"store_mib": 100})
            n, rest = _kept(sdk.invoke("hoard", "30", user="bob")["reply"])
            assert 4 <= n <= 5 and "store_mib cap is 0.5;" in rest, rest
            sdk.put_user("hoard", "cy", limits={"store_mib": 0.25})
            n, rest = _kept(sdk.invoke("hoard", "30", user="cy")["reply"])
            assert 1 <= n <= 2 and "store_mib cap is 0.25;" in rest, rest
            assert sdk.usage(agent="hoard", user="bob")["caps"]["store_mib"]["limit"] == 0.5
    finally:
        host.stop()
