"""Templates nobody needs any more leave one host's disk: a redeploy's old template (its users keep their instances
and run the new code), fork templates of a user without instances; nothing younger than the grace is touched."""

from __future__ import annotations

import json
from pathlib import Path

from moorage.fleet.gc import TemplateGC, template_use
from moorage.store import EntityKey
from tests.runtime.conftest import earlier_fork_template, write_agent

V1 = '''
async def on_message(ctx, message):
    try:
        n = int(ctx.files.read("n.txt"))
    except Exception:
        n = 0
    ctx.files.write("n.txt", str(n + 1))
    return f"v1 {n + 1}"
'''
V2 = V1.replace('"v1 ', '"v2 ')


def _local(env) -> tuple[set[str], set[str]]:  # noqa: ANN001
    """(deployments with a template meta on this host, template directories in the driver's templates dir)."""
    tpl = env.runtime.templates
    metas = {p.stem for p in tpl.root.glob("*.json")}
    tdir = tpl._templates_dir()
    dirs = {p.name for p in tdir.iterdir() if not p.name.startswith(".")} if tdir.is_dir() else set()
    return metas, dirs


async def test_a_redeploys_old_template_goes_and_its_users_run_on(env, tmp_path: Path) -> None:
    root = write_agent(tmp_path / "agent", "counter", V1)
    d1 = await env.runtime.deploy(env.principal, root)
    t1 = env.runtime.templates.cached(d1.id)
    assert t1 is not None
    assert (await env.runtime.invoke(env.principal, EntityKey("counter", "ann"), "hi")).reply == "v1 1"
    (root / "agent.py").write_text(V2)
    d2 = await env.runtime.deploy(env.principal, root)
    t2 = env.runtime.templates.cached(d2.id)
    assert t2 is not None and t2.id != t1.id
    assert _local(env) == ({d1.id, d2.id}, {t1.id, t2.id})

    # Within the grace nothing goes, even what nobody needs.
    gc = TemplateGC(env.store, env.runtime.templates, grace_s=3600)
    assert (await gc.run()).local_deleted == 0
    assert _local(env) == ({d1.id, d2.id}, {t1.id, t2.id})

    gc = TemplateGC(env.store, env.runtime.templates, grace_s=0)
    use = template_use(env.store, grace_s=0)
    assert d2.id in use.deployments and d1.id not in use.deployments
    assert t1.id in use.pinned  # ann's instance row names it; a process fork does not need it (its files are copies)
    rep = await gc.run()
    assert rep.local_deleted == 1
    assert _local(env) == ({d2.id}, {t2.id})
    assert not Path(t1.path).exists()
    # Ann keeps her instance (and its files) and runs the new code; a new user forks the live template.
    assert (await env.runtime.invoke(env.principal, EntityKey("counter", "ann"), "hi")).reply == "v2 2"
    assert (await env.runtime.invoke(env.principal, EntityKey("counter", "bob"), "hi")).reply == "v2 1"
    assert (await gc.run()).local_deleted == 0  # idempotent
    assert _local(env) == ({d2.id}, {t2.id})

    # A rollback to the collected deployment makes its template again.
    await env.runtime.rollback(env.principal, "counter", d1.number)
    t1b = env.runtime.templates.cached(d1.id)
    assert t1b is not None and Path(t1b.path).exists()
    assert (await env.runtime.invoke(env.principal, EntityKey("counter", "cid"), "hi")).reply == "v1 1"
    assert (await gc.run()).local_deleted == 1  # now d2's is the replaced one
    assert _local(env)[0] == {d1.id}


async def test_fork_templates_go_once_their_user_has_no_instance(env, tmp_path: Path) -> None:
    await env.runtime.deploy(env.principal, write_agent(tmp_path / "agent", "counter", V1))
    await env.runtime.invoke(env.principal, EntityKey("counter", "ann"), "hi")
    await env.runtime.invoke(env.principal, EntityKey("counter", "bob"), "hi")
    ts = env.store.tenant(env.principal)
    sid = {r.scope.user: r.id for r in ts.sandboxes.list()}
    made = {u: (await earlier_fork_template(env.runtime, ts.tenant_id, sid[u], "counter", u))[1].id for u in ("ann", "bob")}
    forks = env.runtime.templates._forks_dir()
    assert {json.loads(p.read_text())["user"] for p in forks.glob("*.json")} == {"ann", "bob"}

    gc = TemplateGC(env.store, env.runtime.templates, grace_s=0)
    assert (await gc.run()).local_deleted == 0  # both users have their instances
    # Ann is forgotten by another host of a fleet (the store's half of forget; this host's disk was not asked):
    # this host's collection finds her fork template without an owner and deletes it.
    ts.forget_user("ann", "counter")
    assert (await gc.run()).local_deleted == 1
    assert {json.loads(p.read_text())["user"] for p in forks.glob("*.json")} == {"bob"}
    assert _local(env)[1] == {env.runtime.templates.cached(ts.agents.get("counter").live_deployment).id, made["bob"]}
    assert (await env.runtime.invoke(env.principal, EntityKey("counter", "bob"), "hi")).reply == "v1 2"


async def test_a_deploy_asks_the_hosts_collector_to_run(env, tmp_path: Path) -> None:
    gc = TemplateGC(env.store, env.runtime.templates, grace_s=0)
    env.runtime.templates.gc = gc
    root = write_agent(tmp_path / "agent", "counter", V1)
    d1 = await env.runtime.deploy(env.principal, root)
    (root / "agent.py").write_text(V2)
    assert gc._soon is not None  # the first deploy asked too (nothing to collect then)
    await gc._soon
    first = gc._soon
    d2 = await env.runtime.deploy(env.principal, root)
    assert gc._soon is not first
    await gc._soon  # the run the second deploy started, in the background
    assert _local(env)[0] == {d2.id} and d1.id not in _local(env)[0]
    await gc.close()


async def test_a_host_drops_its_cached_template_once_the_bucket_retired_it(env, tmp_path: Path) -> None:
    from moorage.fleet.gc import BucketCollector
    from moorage.fleet.templates import PublishedTemplates
    from moorage.objects.local import LocalObjectStore

    objects = LocalObjectStore(tmp_path / "bucket")
    published = PublishedTemplates(objects, env.runtime.driver)
    env.runtime.templates.published = published
    root = write_agent(tmp_path / "agent", "counter", V1)
    d1 = await env.runtime.deploy(env.principal, root)
    t1 = env.runtime.templates.cached(d1.id)
    assert published.chosen(d1.id)["template_id"] == t1.id
    (root / "agent.py").write_text(V2)
    await env.runtime.deploy(env.principal, root)
    # Another host's collection retired d1's template in the bucket; this host still has it cached.
    rep = BucketCollector(published, grace_s=0, settle_s=60).collect(lambda: template_use(env.store, grace_s=0))
    assert rep.retired == 1 and published.chosen(d1.id) is None and env.runtime.templates.cached(d1.id) == t1
    # A rollback to d1 does not fork the retired template: this host drops it and makes (and publishes) a new one.
    await env.runtime.rollback(env.principal, "counter", d1.number)
    t1b = env.runtime.templates.cached(d1.id)
    assert t1b is not None and t1b.id != t1.id and not Path(t1.path).exists()
    assert published.chosen(d1.id)["template_id"] == t1b.id
    assert (await env.runtime.invoke(env.principal, EntityKey("counter", "dan"), "hi")).reply == "v1 1"
