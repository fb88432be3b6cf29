"""In a fleet, the packages a template's builder installed are published beside the template, so an instance on
another host whose deployment's packages changed (runtime/instance_update.py: a micro-VM's own disk) gets them
from there instead of running pip again (or failing, in a VM without a relay). Process driver, local bucket: the
mechanism is the runtime's, not the driver's."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import AsyncIterator

import pytest

from moorage.egress import Egress
from moorage.fleet.templates import PublishedTemplates
from moorage.objects.local import LocalObjectStore
from moorage.runtime.deploy_packages import MARKER, SITE_DIR, PackageInstallFailed, digest
from moorage.runtime.templates import Templates
from tests.runtime.conftest import Env, make_env, write_agent
from tests.runtime.test_shared_packages_up import index  # noqa: F401 - the loopback index fixture (tabulate)


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    async for e in make_env(tmp_path, "process"):
        yield e


async def test_another_hosts_instance_installs_the_packages_the_templates_builder_published(
        env: Env, tmp_path: Path, index: str) -> None:  # noqa: F811
    cfg = env.cfg.with_(egress_package_index=index, package_index_url=index + "/simple/")
    driver = env.runtime.driver
    driver.config = cfg
    # As a driver whose forks own their files (micro-VM): the process driver's forks bind the template's packages
    # instead, so its templates publish none.
    driver.capabilities = dataclasses.replace(driver.capabilities, shares_template_dirs=False)
    env.runtime.templates.egress = Egress.from_config(cfg)
    objects = LocalObjectStore(tmp_path / "bucket")
    published = PublishedTemplates(objects, driver)
    env.runtime.templates.published = published
    src = write_agent(tmp_path / "tab", "tab", "import tabulate\n\nasync def on_message(ctx, m):\n    return 'ok'\n")
    (src / "requirements.txt").write_text("tabulate\n")
    dep = await env.runtime.deploy(env.principal, src)
    ref = env.runtime.templates.cached(dep.id)
    assert ref is not None
    [entry] = [o.key for o in objects.iter(f"templates/{ref.id}/packages/")]

    # Another host: an empty package cache, and an egress that admits no package index (pip would be refused).
    other = Templates(tmp_path / "templates-b", driver, tmp_path / "packages-b")
    other.published = published
    other.egress = Egress.from_config(cfg.with_(egress_package_index=""))
    sb = await driver.create("on-host-b")
    await sb.start()
    said: list[str] = []
    with pytest.raises(PackageInstallFailed, match="not allowed"):  # without the template to fetch from
        await other.install_packages(sb, b"tabulate\n", dep.agent_id, said.append)
    assert await other.install_packages(sb, b"tabulate\n", dep.agent_id, said.append, template=ref) == "cached"
    assert "packages from the template's published copy" in said
    assert (tmp_path / "templates-b" / "package-cache" / entry.rsplit("/", 1)[1]).exists()  # kept for the next
    r = await sb.exec(["python3", "-c", "import tabulate, sys; print(tabulate.__file__)"], env={"PYTHONPATH": SITE_DIR})
    assert r.stdout.decode().strip() == f"{SITE_DIR}/tabulate/__init__.py", r.stderr
    assert await sb.read_file(MARKER) == digest(b"tabulate\n").encode()
    # Another agent's instance never gets them: the key names the agent.
    with pytest.raises(PackageInstallFailed, match="not allowed"):
        await other.install_packages(sb, b"tabulate\n", "another-agent", said.append, template=ref)
    await sb.destroy()
