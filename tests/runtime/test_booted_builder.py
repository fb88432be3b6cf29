"""A deploy's builder resumes this host's booted sandbox of its size instead of booting (``runtime/booted.py``).

On the micro-VM driver: the first build boots and keeps the booted state; the next ones fork it; the deployment's
template stands on the guest image alone (what a fleet publishes) and serves turns; a booted template that went
is made again. The records' policy (which stay, which go, one a crash left) runs on the process driver with a
key, where a boot costs what a fork does.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path
from typing import AsyncIterator

import pytest

from moorage.fleet.gc import TemplateUse
from moorage.runtime import booted
from moorage.sandbox import SandboxSpec
from moorage.sandbox.microvm_files import qcow2_backing
from moorage.sandbox.process import ProcessDriver
from moorage.store import EntityKey
from tests.runtime.conftest import Env, make_env, write_agent

VERSION = """
import os

async def on_message(ctx, message):
    return "v{n}: " + message + " " + ",".join(sorted(os.listdir("/work/.moorage/agents")))
"""


@pytest.fixture
async def vm_env(tmp_path: Path) -> AsyncIterator[Env]:
    async for e in make_env(tmp_path, "microvm"):
        yield e


def _agent(tmp_path: Path, n: int, extra: str = "") -> Path:
    return write_agent(tmp_path / f"v{n}", "hello", VERSION.format(n=n), extra)


async def test_a_builder_resumes_the_booted_sandbox_of_its_size_and_the_template_stands_alone(
        vm_env: Env, tmp_path: Path) -> None:
    env = vm_env
    templates = env.runtime.templates
    said: list[str] = []
    await env.runtime.deploy(env.principal, _agent(tmp_path, 1), on_progress=said.append)
    assert any(m.startswith("kept the booted sandbox") for m in said), said
    (record,) = templates.booted._records()
    boot_id = json.loads(record.read_text())["template"]["id"]
    assert boot_id.startswith(booted.PREFIX)

    # Another tenant's deploy of the same size resumes it: it holds nothing of the first tenant's agent.
    _, key = env.store.operator.create_tenant("globex")
    other = env.store.authenticate(key.secret)
    said.clear()
    dep = await env.runtime.deploy(other, _agent(tmp_path, 2), on_progress=said.append)
    assert any(m.startswith("resumed this host's booted sandbox") for m in said), said
    assert not any(m.startswith("kept") for m in said), said
    # Its disk is an overlay on the image itself, as a booted builder's is: publishable, and independent of the
    # booted template (whose RAM the host holds in memory only while a builder forks it).
    ref = templates.cached(dep.id)
    assert ref is not None
    assert qcow2_backing(Path(ref.path) / "disk.qcow2") == str(env.runtime.driver.image().rootfs)
    assert (await env.runtime.invoke(other, EntityKey("hello", "ada"), "hi")).reply == f"v2: hi {dep.id}"

    # Another size is another shape: its builder boots, and both shapes' booted states are kept.
    said.clear()
    await env.runtime.deploy(env.principal, _agent(tmp_path, 3, "memory_mib = 320\n"), on_progress=said.append)
    assert any(m.startswith("kept the booted sandbox") for m in said), said
    assert len(templates.booted._records()) == 2

    # A booted template can go at any time (removed by hand here): the next build of its size boots again.
    shutil.rmtree(env.runtime.driver.template_dir(boot_id))
    said.clear()
    dep = await env.runtime.deploy(env.principal, _agent(tmp_path, 4), on_progress=said.append)
    assert any(m.startswith("kept the booted sandbox") for m in said), said
    assert boot_id not in templates.booted.names()
    assert (await env.runtime.invoke(env.principal, EntityKey("hello", "bob"), "hi")).reply == f"v4: hi {dep.id}"
    assert not list(Path(env.runtime.driver.root).glob("tpl-*"))  # no builder left


class KeyedProcessDriver(ProcessDriver):
    """The process driver with a boot key: the booted templates' bookkeeping, without the kernel boots."""

    async def boot_key(self, spec: SandboxSpec) -> str | None:
        return hashlib.sha256(json.dumps(spec.to_json(), sort_keys=True).encode()).hexdigest()


@pytest.fixture
async def keyed_env(tmp_path: Path) -> AsyncIterator[Env]:
    async for e in make_env(tmp_path, "process", KeyedProcessDriver):
        yield e


async def test_the_booted_templates_of_the_shapes_built_last_stay_and_a_crashs_is_collected(
        keyed_env: Env, tmp_path: Path) -> None:
    env = keyed_env
    templates = env.runtime.templates
    sizes = [256, 288, 320, 352]
    for n, mib in enumerate(sizes):
        said: list[str] = []
        await env.runtime.deploy(env.principal, _agent(tmp_path, n, f"memory_mib = {mib}\n"), on_progress=said.append)
        assert any(m.startswith("kept the booted sandbox") for m in said), (mib, said)
        time.sleep(0.01)  # the records' ages tell which shape was built last
    records = templates.booted._records()
    assert len(records) == booted.KEPT
    kept = templates.booted.names()
    on_disk = {p.name for p in templates._templates_dir().iterdir() if p.name.startswith(booted.PREFIX)}
    assert kept == on_disk, (kept, on_disk)  # the oldest shape's went with its record

    # A rebuild of a kept shape resumes it and marks it used: it stays when yet another shape comes.
    said = []
    await env.runtime.deploy(env.principal, _agent(tmp_path, 9, f"memory_mib = {sizes[1]}\n"), on_progress=said.append)
    assert any(m.startswith("resumed this host's booted sandbox") for m in said), said
    assert (await env.runtime.invoke(env.principal, EntityKey("hello", "ada"), "hi")).reply.startswith("v9: hi ")

    # A booted template no record names (a crash between its making and its record) is the collector's.
    record = templates.booted._records()[0]
    orphan = json.loads(record.read_text())["template"]["id"]
    record.unlink()
    use = TemplateUse(deployments=frozenset(), pinned=frozenset(), users=frozenset())
    assert templates._abandoned(orphan, use)
    assert templates.booted.names() and not any(templates._abandoned(t, use) for t in templates.booted.names())
    assert await templates.collect(use, grace_s=0) >= 1
    assert not templates.driver.template_dir(orphan).exists()
