"""Retention in the object store, in a fleet of `moorage up` hosts (one PostgreSQL, one SeaweedFS): after a redeploy
nothing of the old deployment's template is left in the bucket or on any host while its users run on; after a
user with fork templates (a time-travel fork, a sandbox fork) is forgotten, nothing of that user is left in the
bucket or on any host, and the end-user forked from them runs on with their own copy; after a deployment is
deleted, its package leaves the bucket and every host's disk."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.fleet.harness import Fleet, until


@pytest.fixture
def s3(seaweedfs, s3_bucket, tmp_path: Path) -> dict[str, str]:  # noqa: ANN001
    return seaweedfs.settings(s3_bucket, f"gc-{tmp_path.name}")


def _ok(r: httpx.Response) -> str:
    assert r.status_code in (200, 201), r.text
    return r.json()["reply"]



def test_a_redeploy_and_a_forget_leave_nothing_of_the_old_template_or_the_user(tmp_path: Path, pg_url: str,
                                                                               s3: dict[str, str], seaweedfs,  # noqa: ANN001
                                                                               s3_bucket: str) -> None:
    # Every host collects every second; nothing younger than 5 s is touched (a deploy between its template's
    # publication and going live); a retired template waits 1 s before it is deleted.
    f = Fleet(tmp_path, pg_url, s3, n=2, template_gc_interval_s="1", template_gc_grace_s="5",
              template_gc_settle_s="1")
    raw = seaweedfs.client()
    prefix = s3["object_store_url"].split("/", 3)[3]

    def keys() -> list[str]:
        out, token = [], None
        while True:
            kw = {"ContinuationToken": token} if token else {}
            page = raw.list_objects_v2(Bucket=s3_bucket, Prefix=f"{prefix}/", **kw)
            out += [o["Key"][len(prefix) + 1:] for o in page.get("Contents", [])]
            if not page.get("IsTruncated"):
                return out
            token = page["NextContinuationToken"]

    def live() -> tuple[str, str]:
        dep = f.live_deployment()
        import json

        claim = json.loads(raw.get_object(Bucket=s3_bucket, Key=f"{prefix}/deployments/{dep}/template.json")["Body"].read())
        return dep, claim["template_id"]

    def on_hosts(name: str) -> list[Path]:
        return [p for h in f.hosts for p in (h.data / "templates").rglob(f"{name}*")] + \
               [p for h in f.hosts for p in (h.data / "sandboxes" / ".templates").glob(f"{name}*")]

    try:
        f.deploy()
        d1, t1 = live()
        assert _ok(f.turn(0, "ann")) == "1: hi"
        assert _ok(f.turn(1, "bob")) == "1: hi"  # h2 fetched d1's template from the bucket
        for user, via in (("ann", 0), ("bob", 1)):
            r = f.api[via].post(f"/v1/sandboxes/{f.records()[user].id}/sleep")
            assert r.status_code == 200 and r.json()["slept"] is True, r.text
        assert any(k.startswith(f"templates/{t1}/") for k in keys()) and on_hosts(t1)

        agent_dir = tmp_path / "echo"
        (agent_dir / "agent.py").write_text((agent_dir / "agent.py").read_text().replace('f"{n + 1}: ', 'f"v2 {n + 1}: '))
        from moorage.cli.up import tar_dir

        r = f.api[0].post("/v1/agents/echo/deployments", content=tar_dir(agent_dir),
                          headers={"Content-Type": "application/gzip"})
        assert r.status_code == 201, r.text
        d2, t2 = live()
        assert d2 != d1 and t2 != t1
        # The users keep their instances (and files) and run the new code, each on the other host.
        assert _ok(f.turn(1, "ann")) == "v2 2: hi"
        assert _ok(f.turn(0, "bob")) == "v2 2: hi"
        assert _ok(f.turn(1, "cid")) == "v2 1: hi"
        # Every template of the old deployment: the claimed one, and any a host built and published but lost the
        # claim race with (fleet/templates.py: shipped first, then claimed; the collector takes the loser too).
        old = f"dep-{d1[:24]}-"
        assert t1.startswith(old) and not t2.startswith(old)
        until(lambda: not [k for k in keys() if k.startswith((f"templates/{old}", f"deployments/{d1}/"))],
               "the old deployment's templates and claim leave the bucket")
        until(lambda: not on_hosts(old) and not [p for h in f.hosts for p in (h.data / "templates").glob(f"{d1}.json")],
               "the old templates leave both hosts")
        assert {k.split("/")[1] for k in keys() if k.startswith("templates/")} == {t2}
        assert {k.split("/")[1] for k in keys() if k.startswith("deployments/")} == {d2}
        # Deployment 1 deleted through the host that did not deploy it: its package leaves the bucket (in two
        # steps) and both hosts' disks; deployment 2's stays.
        sha = {d["number"]: d["package_sha256"] for d in f.api[1].get("/v1/agents/echo/deployments").json()["data"]}
        assert f.api[1].delete("/v1/agents/echo/deployments/1").json()["status"] == "deleted"
        until(lambda: f"packages/{sha[1]}.tar.gz" not in keys()
              and not [p for h in f.hosts for p in (h.data / "packages").glob(f"{sha[1]}*")],
              "the deleted deployment's package leaves the bucket and the hosts")
        assert f"packages/{sha[2]}.tar.gz" in keys() and (f.hosts[0].data / "packages" / f"{sha[2]}.tar.gz").exists()

        # Xia is forked twice, at a checkpoint (into yan) and as she is now by the sandbox verb (into zoe); then she
        # is forgotten.
        assert _ok(f.turn(0, "xia")) == "v2 1: hi"
        r = f.api[0].post("/v1/agents/echo/users/xia/checkpoints", json={"name": "one"})
        assert r.status_code == 201, r.text
        ck = r.json()["id"]
        assert _ok(f.turn(0, "xia")) == "v2 2: hi"
        r = f.api[0].post(f"/v1/agents/echo/users/xia/checkpoints/{ck}/fork", json={"to_users": ["yan"]})
        assert r.status_code == 201, r.text
        xia = f.records()["xia"].id
        r = f.api[1].post(f"/v1/sandboxes/{xia}/fork", json={"to_user": "zoe"})  # whichever host holds her
        assert r.status_code == 200, r.text
        assert [x["user"] for x in r.json()["forks"]] == ["zoe"]
        for user in ("xia", "yan"):
            r = f.api[0].post(f"/v1/sandboxes/{f.records()[user].id}/sleep")
            assert r.status_code == 200, r.text
        yan = f.records()["yan"].id
        assert [k for k in keys() if f"/{xia}/" in k] and [k for k in keys() if f"/{yan}/" in k]

        r = f.api[1].delete("/v1/agents/echo/users/xia")
        assert r.status_code in (200, 204), r.text
        assert not [k for k in keys() if xia in k]
        until(lambda: not on_hosts("tt-") and not on_hosts("fork-"),
               "the user's fork templates leave every host")
        assert "xia" not in f.records()
        leftover = [k for k in keys() if not k.startswith(("instances/", f"templates/{t2}/", f"deployments/{d2}/",
                                                           "packages/"))]
        assert leftover == []
        # Yan and zoe are users of their own: their copies of xia (at checkpoint "one", and after turn 2) run on.
        assert _ok(f.turn(1, "yan")) == "v2 2: hi"
        assert _ok(f.turn(1, "zoe")) == "v2 3: hi"
        assert [k for k in keys() if f"/{yan}/" in k]
    finally:
        f.close()
