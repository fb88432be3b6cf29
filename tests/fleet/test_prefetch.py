"""A fleet host fetches live deployments' templates before their first wake on it (``fleet/prefetch.py``): the
agents with most instances first, up to the limit, never a deployment nobody published, never one it has, and
nothing while its disk is short of room; a wake afterwards finds the template here.

In process, on both store backends and both object stores; `test_fleet.py` has a host started after a deploy.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from moorage.config import Config
from moorage.fleet import prefetch as prefetch_mod
from moorage.fleet.prefetch import TemplatePrefetch, live_deployments
from moorage.fleet.templates import PublishedTemplates
from moorage.objects import ObjectStore
from moorage.runtime.templates import Templates
from moorage.sandbox.process import ProcessDriver
from moorage.store import Scope, Store
from tests.fleet.harness import Fleet, until
from tests.fleet.test_templates import _template


def _live(store: Store, ts: Any, name: str, instances: int) -> Any:
    agent = ts.agents.create(name)
    dep = ts.deployments.create(agent.id, {}, f"packages/{name}.tar.gz", "0" * 64)
    ts.agents.update(agent.id, expected_version=agent.version, live_deployment=dep.id)
    for i in range(instances):
        ts.sandboxes.create(Scope.for_user(name, f"u{i}"), state="sleeping")
    return dep


def test_live_templates_are_fetched_ahead_most_used_first_up_to_the_limit(
        store: Store, object_store: ObjectStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = Config(data_dir=tmp_path / "cfg")
    maker, here = ProcessDriver(tmp_path / "a", cfg), ProcessDriver(tmp_path / "b", cfg)
    published = PublishedTemplates(object_store, maker)
    tenants = []
    for name in ("acme", "globex"):
        _, key = store.operator.create_tenant(name)
        tenants.append(store.tenant(store.authenticate(key.secret)))
    acme, globex = tenants
    deps = {"busy": _live(store, acme, "busy", 3), "quiet": _live(store, acme, "quiet", 0),
            "other": _live(store, globex, "other", 1), "unpublished": _live(store, globex, "unpublished", 2)}
    for name in ("busy", "quiet", "other"):
        d = deps[name]
        published.publish(_template(maker, f"builder-{name}", f"dep-{d.id[:24]}-{name[:6]:a<6}", name), d.id)

    order = [(live.agent, live.instances) for live in live_deployments(store)]
    assert order == [("busy", 3), ("unpublished", 2), ("other", 1), ("quiet", 0)]

    templates = Templates(tmp_path / "templates-b", here, tmp_path / "packages-b")
    templates.published = PublishedTemplates(object_store, here)
    pf = TemplatePrefetch(store, templates, limit=3, interval_s=60)
    # The three with most instances: busy and other fetched; unpublished is its deploying host's to build.
    assert asyncio.run(pf.run()) == 2
    assert templates.cached(deps["busy"].id) is not None and templates.cached(deps["other"].id) is not None
    assert templates.cached(deps["quiet"].id) is None and templates.cached(deps["unpublished"].id) is None
    assert asyncio.run(here.list()) == []  # nothing was built (no builder sandbox)
    ref = templates.cached(deps["busy"].id)
    assert (Path(ref.path) / "layer" / "work" / "agent.txt").read_text() == "busy"
    assert asyncio.run(pf.run()) == 0  # what this host has is not fetched again

    # A host short of disk fetches nothing more ahead (a wake still would).
    monkeypatch.setattr(prefetch_mod, "MIN_FREE_BYTES", 1 << 60)
    assert asyncio.run(TemplatePrefetch(store, templates, limit=10, interval_s=60).run()) == 0
    assert templates.cached(deps["quiet"].id) is None
    monkeypatch.setattr(prefetch_mod, "MIN_FREE_BYTES", 0)
    assert asyncio.run(TemplatePrefetch(store, templates, limit=10, interval_s=60).run()) == 1
    # A wake of the deployment now uses the template fetched ahead: the same one, nothing fetched or built.
    before = {p.name for p in (here.root / ".templates").iterdir()}
    got = asyncio.run(templates.ensure(deps["quiet"]))
    assert got.id == templates.cached(deps["quiet"].id).id
    assert {p.name for p in (here.root / ".templates").iterdir()} == before
    assert asyncio.run(TemplatePrefetch(store, templates, limit=0, interval_s=60).run()) == 0  # 0: off


@pytest.fixture
def s3(seaweedfs, s3_bucket, tmp_path: Path) -> dict[str, str]:  # noqa: ANN001
    return seaweedfs.settings(s3_bucket, f"prefetch-{tmp_path.name}")



def test_hosts_of_a_fleet_have_the_live_template_before_their_first_wake(tmp_path: Path, pg_url: str,
                                                                         s3: dict[str, str]) -> None:
    f = Fleet(tmp_path, pg_url, s3, n=2, template_prefetch_interval_s="1")
    try:
        f.deploy()
        dep_id = f.live_deployment()

        def has(i: int) -> bool:
            return (f.hosts[i].data / "templates" / f"{dep_id}.json").exists()

        def fetches(i: int) -> tuple[int, int]:
            """(templates fetched from the object store, of which ahead of a wake) in host i's log."""
            lines = f.hosts[i].log.read_text(errors="replace").splitlines()
            return (sum(1 for ln in lines if "template fetched " in ln and "ahead" not in ln),
                    sum(1 for ln in lines if "template fetched ahead of its first wake" in ln))

        # h2 was up before the deploy: its next pass fetches the new live template, with no request to it.
        until(lambda: has(1) and fetches(1) == (1, 1), "h2 fetches the deployed template ahead, once",
              timeout_s=60, every_s=0.2)
        assert _ok(f.turn(0, "ann")) == "1: hi"
        r = f.api[0].post(f"/v1/sandboxes/{f.records()['ann'].id}/sleep")
        assert r.status_code == 200 and r.json()["slept"] is True, r.text

        # h3 joins after the deploy: its first pass at start fetches the template; ann's wake there uses it.
        h3 = f.add_host(template_prefetch_interval_s="1")
        until(lambda: has(h3) and fetches(h3) == (1, 1), "h3 fetches the live template at start",
              timeout_s=60, every_s=0.2)
        assert _ok(f.turn(h3, "ann")) == "2: hi"
        assert f.records()["ann"].host == "h3"
        assert fetches(h3) == (1, 1)  # the wake fetched nothing more
    finally:
        f.close()


def _ok(r: Any) -> str:
    assert r.status_code == 200, r.text
    return r.json()["reply"]
