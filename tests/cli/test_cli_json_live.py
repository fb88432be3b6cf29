"""`--json` of the CLI's client commands against a real server over the real runtime (process sandboxes, SQLite):
one JSON document on stdout with what the human output shows; a failure exits non-zero with one line on stderr.

Each command runs in a thread: the server and its runtime live on the test's event loop.
"""

from __future__ import annotations

import json

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
