"""What an agent author meets while writing examples/researcher, on a real `moorage up` (process driver): the error
of an agent whose code raised names the line of their code, a background process started with ctx.exec times out
with an error that says how to start one, ctx.spawn starts one that outlives the turn, and a misspelt setting in
moorage.toml is named with the setting meant, and a step the host refuses for good fails at once, not retried."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

import pytest

from moorage import Client
from moorage.client import BadRequest, ServerError
from moorage.devservices.fleet import LocalHost

AGENT_PY = '''\
import json, os


def parse(text):
    return json.loads(text)["topic"]


async def on_message(ctx, message):
    if message == "boom":
        return parse("{}")
    if message == "background":
        return await ctx.exec(["sh", "-c", "sleep 30 &"], timeout=2)
    if message == "spawn":
        return await ctx.spawn(["sh", "-c", "echo up; sleep 30"], log="logs/sleeper.log")
    if message == "denied":
        return await ctx.step("search", ctx.fetch, "http://127.0.0.1:9/search")
    if message == "spawn-short":
        return await ctx.spawn(["sleep", "0.2"])
    if message.startswith("alive "):
        pid = int(message.split()[1])
        log = ctx.files.read("logs/sleeper.log") if ctx.files.exists("logs/sleeper.log") else None
        return {"alive": os.path.exists("/proc/%d" % pid), "log": log}
    return "ok"
'''


def _agent(base: Path, toml_extra: str = "", name: str = "probe") -> Path:
    base.mkdir(parents=True, exist_ok=True)
    (base / "moorage.toml").write_text(f'[agent]\nname = "{name}"\nentry = "agent.py"\n' + toml_extra +
                                       '[agent.lifecycle]\nusers = "auto"\n')
    (base / "agent.py").write_text(AGENT_PY)
    return base


@pytest.fixture(scope="module")
def sdk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Client]:
    root = tmp_path_factory.mktemp("probe")
    host = LocalHost("up", root / "data", {"MOORAGE_LOG_LEVEL": "warning"}, start_timeout_s=120)
    client = Client(host.url, host.key, timeout_s=120)
    try:
        client.deploy("probe", str(_agent(root / "agent")))
        yield client
    finally:
        client.close()
        host.stop()


def test_an_exception_in_the_agent_names_the_line_of_its_code(sdk: Client) -> None:
    with pytest.raises(ServerError) as e:
        sdk.invoke("probe", "boom", user="u1")
    assert e.value.code == "agent-error" and "KeyError: 'topic'" in str(e.value), e.value
    assert e.value.hint == ('raised at agent.py, line 5, in parse: return json.loads(text)["topic"] '
                            "(fix the agent's code and deploy it again)"), e.value.hint


def test_a_background_process_left_holding_ctx_exec_says_to_spawn_it(sdk: Client) -> None:
    started = time.monotonic()
    with pytest.raises(ServerError) as e:
        sdk.invoke("probe", "background", user="u1")
    assert time.monotonic() - started < 30
    assert "did not end within 2 s" in str(e.value) and "ctx.spawn(argv)" in str(e.value), e.value


def test_ctx_spawn_starts_a_process_that_outlives_the_turn(sdk: Client) -> None:
    started = time.monotonic()
    p = sdk.invoke("probe", "spawn", user="u2")["reply"]
    assert time.monotonic() - started < 20 and p["pid"] > 1 and p["log"].endswith("logs/sleeper.log"), p
    time.sleep(0.5)
    assert sdk.invoke("probe", f"alive {p['pid']}", user="u2")["reply"] == {"alive": True, "log": "up\n"}
    short = sdk.invoke("probe", "spawn-short", user="u4")["reply"]
    assert short["log"] is None, short
    time.sleep(1.0)  # it ended, and was reaped: no zombie left that looks alive to the agent's own check
    assert sdk.invoke("probe", f"alive {short['pid']}", user="u4")["reply"] == {"alive": False, "log": None}


def test_a_step_the_host_refuses_for_good_is_not_retried(sdk: Client) -> None:
    with pytest.raises(ServerError) as e:
        sdk.invoke("probe", "denied", user="u3")
    assert "egress to http://127.0.0.1:9" in str(e.value), e.value
    assert e.value.hint.startswith("raised at agent.py, line 16, in on_message:"), e.value.hint
    assert e.value.hint.endswith("(the error says what to change)"), e.value.hint  # not "fix the agent's code"
    failed = [r for r in sdk.list_workflows(agent="probe", status="failed")["data"]]
    steps = [s for r in failed for s in sdk.get_workflow(r["id"])["steps"] if s["name"] == "search"]
    assert [(s["status"], s["attempts"]) for s in steps] == [("failed", 1)], steps  # one attempt, no retries


def test_a_misspelt_setting_in_moorage_toml_is_named_with_the_one_meant(sdk: Client, tmp_path: Path) -> None:
    with pytest.raises(BadRequest) as e:
        sdk.deploy("probe", str(_agent(tmp_path / "typo", "port = [8080]\n")))
    assert "unknown [agent] setting 'port'" in str(e.value) and "did you mean 'ports'?" in str(e.value), e.value


@pytest.mark.parametrize(("code", "said", "hint"), [
    ("async def on_mesage(ctx, message):\n    return 'hi'\n",
     "agent.py has no on_message(ctx, message) handler: it defines on_mesage (rename on_mesage to on_message, or set "
     "handler = 'on_mesage' under [agent] in moorage.toml)", "fix the agent and deploy again"),
    ("import json\nCONFIG = json.loads('{')\n\nasync def on_message(ctx, message):\n    return 'hi'\n",
     "agent failed to load: JSONDecodeError", "raised at agent.py, line 2, in <module>: CONFIG = json.loads('{'); "
                                              "fix the agent and deploy again"),
])
def test_an_agent_that_does_not_load_says_why_and_where(sdk: Client, tmp_path: Path, code: str, said: str,
                                                        hint: str) -> None:
    agent = _agent(tmp_path / "broken", name="broken")
    (agent / "agent.py").write_text(code)
    with pytest.raises(BadRequest) as e:
        sdk.deploy("broken", str(agent))
    assert said in str(e.value) and e.value.hint == hint, (str(e.value), e.value.hint)
