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


async def test_a_fetching_hosts_cache_entries_of_a_replaced_deployment_are_collected(
        env: Env, tmp_path: Path, index: str) -> None:  # noqa: F811
    """The packages an instance on another host brought from a template's published copy stayed in that host's
    cache for good: the record of a template fetched from the fleet named no cache entries, so the collector took
    the cache as not known and deleted nothing, long after that deployment was replaced. Its record now names the
    entries published beside it, and the collector's rule of the building host holds there too."""
    import json
    import time

    cfg = env.cfg.with_(egress_package_index=index, package_index_url=index + "/simple/")
    driver = env.runtime.driver
    driver.config = cfg
    driver.capabilities = dataclasses.replace(driver.capabilities, shares_template_dirs=False)
    env.runtime.templates.egress = Egress.from_config(cfg)
    published = PublishedTemplates(LocalObjectStore(tmp_path / "bucket"), driver)
    env.runtime.templates.published = published
    src = write_agent(tmp_path / "tab", "tab", "import tabulate\n\nasync def on_message(ctx, m):\n    return 'ok'\n")
    (src / "requirements.txt").write_text("tabulate\n")
    dep = await env.runtime.deploy(env.principal, src)
    ref = env.runtime.templates.cached(dep.id)
    assert ref is not None
    plain = await env.runtime.deploy(env.principal, write_agent(tmp_path / "plain", "plain",
                                                                "async def on_message(ctx, m):\n    return 'ok'\n"))

    other = Templates(tmp_path / "templates-b", driver, tmp_path / "packages-b")
    other.published = published
    other.egress = Egress.from_config(cfg.with_(egress_package_index=""))
    for d in (dep, plain):  # both fetched by this host ahead of their first wake (fleet/prefetch.py)
        assert await other.prefetch(d) is not None
    sb = await driver.create("on-host-b")
    await sb.start()
    assert await other.install_packages(sb, b"tabulate\n", dep.agent_id, lambda _: None, template=ref) == "cached"
    await sb.destroy()
    cache = tmp_path / "templates-b" / "package-cache"
    [entry] = [p.name for p in cache.iterdir()]
    named = json.loads(other._meta(dep.id).read_text()).get("package_cache")
    later = time.time() + 3600
    assert other._collect_package_cache(later, grace_s=60) == 0  # its deployment's record names it
    # The deployment replaced: the collector removes its record (and template) from this host, as for one built here.
    other._meta(dep.id).unlink()
    assert other._collect_package_cache(later, grace_s=60) == 1
    assert not (cache / entry).exists()
    assert other._meta(plain.id).exists()  # the other fetched deployment's record stays
    assert named == [entry]
