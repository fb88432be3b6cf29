"""Forgetting a user also deletes the fork templates made from that user's instances (they hold the user's
files: time-travel forks, docs/timetravel.md, and those earlier versions' sandbox `fork` verb left on a host), and
what the host writes under its data dir (packages, templates, records) is private to it.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from moorage.store import EntityKey
from tests.runtime.conftest import earlier_fork_template, env, write_agent  # noqa: F401 - pytest finds the fixture by name

AGENT = '''
async def on_message(ctx, message):
    ctx.files.write("diary.txt", message)
    return "kept"
'''


def _files_containing(root: Path, needle: bytes) -> list[Path]:
    hits = []
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = Path(dirpath) / f
            try:
                if needle in p.read_bytes():
                    hits.append(p)
            except OSError:
                continue
    return hits


async def test_forget_deletes_fork_templates_of_the_user(env, tmp_path: Path) -> None:  # noqa: F811
    await env.runtime.deploy(env.principal, write_agent(tmp_path / "agent", "diary", AGENT))
    alice, bob = f"alice-{uuid.uuid4().hex}", f"bob-{uuid.uuid4().hex}"
    await env.runtime.invoke(env.principal, EntityKey("diary", "alice"), alice)
    await env.runtime.invoke(env.principal, EntityKey("diary", "bob"), bob)
    ts = env.store.tenant(env.principal)
    boxes = {b.scope.user: b.id for b in ts.sandboxes.list(agent_id="diary")}
    fork_a = await earlier_fork_template(env.runtime, ts.tenant_id, boxes["alice"], "diary", "alice")
    fork_b = await earlier_fork_template(env.runtime, ts.tenant_id, boxes["bob"], "diary", "bob")
    [(record_a, ref_a)] = env.runtime.templates.forks_of(ts.tenant_id, "diary", "alice")
    assert (record_a, ref_a.id) == (fork_a[0], fork_a[1].id) and Path(ref_a.path).exists()
    assert _files_containing(Path(ref_a.path), alice.encode()), "the fork holds none of alice's files; proves nothing"

    await env.runtime.forget(env.principal, "diary", "alice")

    assert not Path(ref_a.path).exists() and not record_a.exists()
    assert _files_containing(env.cfg.data_dir, alice.encode()) == []
    [(_, ref_b)] = env.runtime.templates.forks_of(ts.tenant_id, "diary", "bob")
    assert ref_b.id == fork_b[1].id and _files_containing(Path(ref_b.path), bob.encode())


async def test_host_written_files_are_private(env, tmp_path: Path) -> None:  # noqa: F811
    dep = await env.runtime.deploy(env.principal, write_agent(tmp_path / "agent", "diary", AGENT))
    data = env.cfg.data_dir
    packages, templates = data / "packages", data / "templates"
    assert packages.stat().st_mode & 0o777 == 0o700 and templates.stat().st_mode & 0o777 == 0o700
    package = packages / f"{dep.package_sha256}.tar.gz"
    assert package.stat().st_mode & 0o777 == 0o600
    assert (templates / f"{dep.id}.json").stat().st_mode & 0o777 == 0o600
    assert not [p for p in packages.iterdir() if p.name.endswith(".tmp")]


async def test_a_host_keeps_its_data_dir_private(tmp_path: Path) -> None:
    from moorage.config import Config
    from moorage.runtime.host import Host

    data = tmp_path / "data"
    data.mkdir(mode=0o755)  # made by hand with a wide mode: narrowed when the host opens it
    host = Host.open(Config(data_dir=data, sandbox_driver="process"))
    try:
        assert data.stat().st_mode & 0o777 == 0o700
    finally:
        await host.close()
