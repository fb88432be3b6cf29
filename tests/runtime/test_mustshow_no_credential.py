"""No credential is visible inside a sandbox: the model provider's key stays in the host's gateway.

The host's gateway is the ``openai`` provider pointed at a real local OpenAI-wire server that demands a
distinctive API key (a turn only gets a reply if the host sent it). After turns that call ``ctx.llm``, the
key is searched for everywhere the sandbox can reach or hold it: the guest's environment (``env`` run
inside), its files (the sandbox directory on the host, and ``grep -r`` over the guest's own filesystem),
and every guest process's ``/proc/<pid>/environ``, ``cmdline`` and readable memory regions. A marker the
model returned is searched the same way as a positive control, so the search is known to see things.
"""

from __future__ import annotations

import asyncio

import os
import uuid
from pathlib import Path

import pytest

from moorage.config import Config
from moorage.runtime.host import Host
from moorage.sandbox import process_limits as limits
from moorage.store import EntityKey
from tests.llm.wire_servers import MODEL, Canned, WireServer, openai_app
from tests.conftest import unspelled
from tests.runtime.conftest import write_agent

AGENT = '''
import os

SEEN = []

async def on_message(ctx, message):
    text = await ctx.llm.chat(message)
    SEEN.append(text)  # keep the model's words in the guest's memory (the positive control)
    with open("/work/replies.txt", "a") as f:
        f.write(text + "\\n")
    return "model said: " + text
'''


def _completion(text: str) -> Canned:
    return Canned(body={"id": "chatcmpl-" + uuid.uuid4().hex[:12], "object": "chat.completion", "created": 0,
                        "model": MODEL,
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}})


def _scan_memory(pid: int, needles: list[bytes]) -> tuple[dict[bytes, bool], int]:
    """Which needles occur in the readable memory regions of ``pid``; and how many bytes were read."""
    found = {n: False for n in needles}
    read = 0
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
        for line in maps:
            addr, perms = line.split()[:2]
            if not perms.startswith("r"):
                continue
            lo, hi = (int(x, 16) for x in addr.split("-"))
            if hi - lo > 1 << 30:
                continue  # reserved address space, nothing in it
            try:
                mem.seek(lo)
                chunk = mem.read(hi - lo)
            except (OSError, ValueError, OverflowError):
                continue  # [vvar] and friends
            read += len(chunk)
            for n in needles:
                found[n] = found[n] or n in chunk
    return found, read


@pytest.mark.timeout(170)
async def test_no_credential_inside_the_sandbox(tmp_path: Path) -> None:
    secret = f"sk-canary-{uuid.uuid4().hex}{uuid.uuid4().hex[:8]}"
    marker = f"marker-{uuid.uuid4().hex[:12]}"
    with WireServer(openai_app, secret) as wire:
        cfg = Config(data_dir=tmp_path / "data", sandbox_driver="process", llm_provider="openai",
                     llm_base_url=f"{wire.url}/v1", llm_api_key=secret, llm_model=MODEL)
        agent = write_agent(tmp_path / "talker", "talker", AGENT)
        host = Host.open(cfg)
        await host.start()
        try:
            _, key = host.store.operator.create_tenant("acme")
            principal = host.store.authenticate(key.secret)
            await host.runtime.deploy(principal, agent)
            for i in range(3):
                wire.script.push(_completion(f"{marker} number {i}"))
                r = await host.runtime.invoke(principal, EntityKey("talker", "ada"), f"hello {i}")
                assert r.reply == f"model said: {marker} number {i}"
            # The wire server saw the key on every call: it came from the host's gateway.
            assert [q["headers"]["authorization"] for q in wire.script.requests] == [f"Bearer {secret}"] * 3

            ts = host.store.tenant(principal)
            (rec,) = ts.sandboxes.list(agent_id="talker")
            sb = await host.driver.open(rec.id)
            needle, control = secret.encode(), marker.encode()

            # 1. the environment the guest's programs get
            env = await sb.exec(["env"])
            assert env.exit_code == 0 and b"MOORAGE_SANDBOX_ID" in env.stdout
            assert needle not in env.stdout and b"sk-canary" not in env.stdout

            # 2a. files, from inside: everything the guest can read, recursively. The pattern matches the key
            # without spelling it: the key itself never enters the sandbox, whose memory step 3 searches.
            pattern = unspelled(secret)
            for root in ("/work", "/tmp", "/run", "/etc", "/home", "/root", "/opt"):
                g = await sb.exec(["grep", "-r", "-l", "-s", "-e", pattern, root], timeout=60)
                assert g.exit_code != 0 and g.stdout == b"", (root, g.stdout[:500])
            ctl = await sb.exec(["grep", "-r", "-l", "-e", unspelled(marker), "/work"])
            assert ctl.stdout.strip() == b"/work/replies.txt"  # the search (same kind of pattern) sees what is there

            # 2b. files, from the host: the whole sandbox directory (layer, logs, metadata, socket dir, checkpoints).
            # A turn's automatic checkpoint is written after its reply: wait for the turns to end, so none is half
            # made (under a temporary name) while the directory is read.
            for _ in range(600):
                if not host.runtime.turns:
                    break
                await asyncio.sleep(0.05)
            sandbox_dir = cfg.sandboxes_dir / rec.id

            def content(p: Path) -> bytes:
                try:
                    return p.read_bytes()
                except FileNotFoundError:  # a pruned checkpoint removed in the background meanwhile
                    return b""
            # os.walk, not rglob: a directory a background prune removes under the walk is skipped, not raised.
            files = [Path(d) / n for d, _, names in os.walk(sandbox_dir) for n in names]
            files = [p for p in files if not p.is_symlink() and p.is_file()]
            assert files
            with_key = [p for p in files if needle in content(p)]
            assert with_key == []
            assert any(control in content(p) for p in files)

            # 3. processes: every guest process, found under the sandbox's recorded pid
            meta_pid = sb.meta.get("pid")  # type: ignore[attr-defined]
            assert meta_pid
            pids = [meta_pid, *limits.descendants(meta_pid)]
            assert len(pids) >= 2  # the bwrap wrapper and at least the supervisor
            scanned_bytes, control_seen = 0, False
            for pid in pids:
                for part in ("environ", "cmdline"):
                    blob = Path(f"/proc/{pid}/{part}").read_bytes()
                    assert needle not in blob, (pid, part)
                found, n = _scan_memory(pid, [needle, control])
                assert not found[needle], f"the key is in the memory of guest process {pid}"
                scanned_bytes += n
                control_seen = control_seen or found[control]
            # The supervisor's memory holds the model's words, so the scan really reads guest memory.
            assert scanned_bytes > 1 << 20 and control_seen
        finally:
            for sid in await host.driver.list():
                try:
                    await (await host.driver.open(sid)).stop()
                except Exception:  # noqa: BLE001 - best-effort cleanup
                    pass
            await host.close()
    assert os.environ.get("MOORAGE_LLM_API_KEY") != secret
