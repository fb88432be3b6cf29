"""`--json` of the CLI's client commands against a real server over the real runtime (process sandboxes, SQLite):
one JSON document on stdout with what the human output shows; a failure exits non-zero with one line on stderr.

Each command runs in a thread: the server and its runtime live on the test's event loop.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

from moorage import AsyncClient
from tests.api.conftest import acme, agent_archive, live_rt, runtime  # noqa: F401  (fixtures)
from tests.cli.test_cli_live import moorage, store  # noqa: F401  (the helper; the CLI tests' SQLite store)


async def test_forget_json_is_the_apis_answer_and_its_question_is_not_on_stdout(live_rt, acme) -> None:  # noqa: F811
    async with AsyncClient(live_rt.url, acme) as sdk:
        await sdk.deploy("echo", agent_archive(live_rt.data_dir.parent))
        for user in ("ann", "bob"):
            await sdk.invoke("echo", "hello", user=user)
    gone = await moorage(live_rt, acme, "forget", "echo", "ann", "--yes", "--json")
    assert gone.exit_code == 0, gone.output
    said = json.loads(gone.stdout)
    assert isinstance(said["removed"], int) and said["removed"] > 0, said
    human = await moorage(live_rt, acme, "forget", "echo", "bob", "--yes")
    assert human.exit_code == 0 and "forgot bob: " in human.stdout and "records removed" in human.stdout, human.output
    # Asked and declined: the question went to stderr, stdout holds nothing a script would try to parse (but the
    # blank that click's prompt reads input after).
    asked = await moorage(live_rt, acme, "forget", "echo", "cy", "--json")
    assert asked.exit_code == 1 and asked.stdout.strip() == "" and "forget everything about cy" in asked.stderr, asked.output


async def test_user_and_the_sandbox_verbs_take_json_and_print_the_apis_answer(live_rt, acme) -> None:  # noqa: F811
    async with AsyncClient(live_rt.url, acme) as sdk:
        await sdk.deploy("echo", agent_archive(live_rt.data_dir.parent))
        await sdk.invoke("echo", "hello", user="ann")
        box = (await sdk.fleet())["instances"][0]["id"]
    made = await moorage(live_rt, acme, "user", "echo", "ann", "--meta", "plan=pro", "--json")
    assert made.exit_code == 0, made.output
    assert (lambda u: (u["id"], u["agent"], u["metadata"]))(json.loads(made.stdout)) == ("ann", "echo", {"plan": "pro"})
    for verb, extra, key in (("sleep", [], "slept"), ("wake", [], "state"), ("checkpoint", ["--label", "l1"], "checkpoint"),
                             ("fork", ["--to", "bob"], "forks")):
        done = await moorage(live_rt, acme, verb, box, *extra, "--json")
        assert done.exit_code == 0, (verb, done.output)
        answer = json.loads(done.stdout)
        assert answer["id"] == box and key in answer, (verb, answer)
    # Without --json they print the same document (what scripts written before the flag read).
    plain = await moorage(live_rt, acme, "user", "echo", "ann")
    assert plain.exit_code == 0 and json.loads(plain.stdout)["metadata"] == {"plan": "pro"}, plain.output


async def test_a_failure_with_json_exits_2_with_one_error_line_on_stderr_and_nothing_on_stdout(live_rt, acme) -> None:  # noqa: F811
    """The rule the README states: with or without --json, a failure is one line on stderr, stdout stays empty. Run
    as an operator runs it (the console entry point, in a subprocess), against the test's server."""
    async with AsyncClient(live_rt.url, acme) as sdk:
        await sdk.deploy("echo", agent_archive(live_rt.data_dir.parent))
    failing = [["invoke", "nope", "hi", "-u", "ann"], ["users", "nope"], ["user", "nope", "ann"], ["sleep", "sb-nope"],
               ["wake", "sb-nope"], ["checkpoint", "sb-nope"], ["fork", "sb-nope", "--to", "cy"],
               ["share", "echo", "ann", "--revoke", "nope"], ["forget", "nope", "ann", "--yes"], ["trace", "nope"], ["execution", "nope"], ["answer", "nope", "yes"],
               ["rollback", "echo"], ["secrets", "list", "nope"], ["checkpoints", "list", "nope", "ann"],
               ["checkpoints", "take", "echo", "nobody"],
               ["share", "nope", "ann", "--list"], ["logs", "--limit", "0"], ["ps", "--state", "dozing"]]
    env = {**os.environ, "MOORAGE_API_URL": live_rt.url, "MOORAGE_API_KEY": acme, "MOORAGE_DATA_DIR": str(live_rt.data_dir)}
    runs = [(args, ["--json"]) for args in failing] + [(args, []) for args in failing[:3]]
    for args, extra in runs:
        r = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "moorage.cli.main", *args, *extra],
                                    env=env, capture_output=True, text=True, timeout=120)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and r.stdout == "", (args, extra, r.stdout, r.stderr)
        assert len(lines) == 1 and lines[0].startswith("error: ") and lines[0].endswith(")"), (args, r.stderr)
        assert "/v1/" not in lines[0], lines[0]  # what to do next is a command, not the API's route
    # The server down: the same, saying how to start it.
    down = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "moorage.cli.main", "agents", "--json"],
                                   env={**env, "MOORAGE_API_URL": "http://127.0.0.1:9"}, capture_output=True, text=True,
                                   timeout=120)
    assert down.returncode == 2 and down.stdout == "" and "start it with `moorage up`" in down.stderr, down.stderr


async def test_agents_json_has_what_the_table_shows(live_rt, acme) -> None:  # noqa: F811
    async with AsyncClient(live_rt.url, acme) as sdk:
        for version in ("", "2", "3"):
            await sdk.deploy("echo", agent_archive(live_rt.data_dir.parent, version=version))
        await sdk.rollback("echo", 2)
    listed = await moorage(live_rt, acme, "agents", "--json")
    assert listed.exit_code == 0, listed.output
    (echo,) = json.loads(listed.stdout)["data"]
    assert (echo["name"], echo["live_number"], echo["deployments"]) == ("echo", 2, 3), echo
    assert echo["live_deployment"] and echo["updated_at"]  # the API's fields, as they are
    table = await moorage(live_rt, acme, "agents")
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in table.stdout.splitlines() if line.startswith("│")]
    assert [c[:3] for c in cells] == [["echo", "#2", "3"]], table.stdout


async def test_chat_with_an_agent_that_is_not_there_fails_before_the_first_prompt(live_rt, acme) -> None:  # noqa: F811
    async with AsyncClient(live_rt.url, acme) as sdk:
        await sdk.deploy("echo", agent_archive(live_rt.data_dir.parent))
        invoke_only = (await sdk.create_key(["invoke"]))["secret"]
    env = {**os.environ, "MOORAGE_API_URL": live_rt.url, "MOORAGE_DATA_DIR": str(live_rt.data_dir)}

    def chat(key: str, agent: str, typed: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "moorage.cli.main", "chat", agent, "-u", "ann"], input=typed,
                              env={**env, "MOORAGE_API_KEY": key}, capture_output=True, text=True, timeout=120)

    gone = await asyncio.to_thread(chat, acme, "nope", "hello\n\n")
    assert gone.returncode == 2 and gone.stdout == "", (gone.stdout, gone.stderr)
    assert gone.stderr.splitlines() == ["error: 404: no agent 'nope' (`moorage agents` lists them; `moorage deploy` "
                                        "makes one)"], gone.stderr
    # A key that may invoke but not read the agent still chats.
    talked = await asyncio.to_thread(chat, invoke_only, "echo", "hello\n\n")
    assert talked.returncode == 0 and "echo › echo: hello" in talked.stdout, (talked.stdout, talked.stderr)
