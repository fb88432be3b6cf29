"""Micro-VM time-travel forks in a fleet: the fork template is published (its disk made an overlay on the guest
image), so a forked user's VM wakes on a host that never saw it, memory and files included; the template stays in
the bucket while a fork needs it, forgetting its source user included, and goes once no instance names it."""

from __future__ import annotations

import json
import time
from pathlib import Path

from moorage.cli.up import tar_dir
from tests.fleet.harness import until
from tests.fleet.test_microvm_fleet import Hosts, _agent, _backing, _turn, hosts, s3  # noqa: F401 - fixtures

GRACE_S = 30



def test_a_forked_users_vm_wakes_on_another_host_and_its_template_goes_with_the_last_fork(
        hosts: Hosts, tmp_path: Path, seaweedfs, s3_bucket: str, s3: dict[str, str]) -> None:  # noqa: ANN001, F811
    # Every host collects every 2 s; the grace covers a fork from its template's publication to its instance's
    # row (seconds of VM work on this loaded 2-core host).
    hosts.env.update({"MOORAGE_TEMPLATE_GC_INTERVAL_S": "2", "MOORAGE_TEMPLATE_GC_GRACE_S": str(GRACE_S),
                      "MOORAGE_TEMPLATE_GC_SETTLE_S": "1"})
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

    def templates() -> set[str]:
        return {k.split("/")[1] for k in keys() if k.startswith("templates/")}

    a = hosts.start("h1")
    r = a.post("/v1/agents/echo/deployments", content=tar_dir(_agent(tmp_path)), headers={"Content-Type": "application/gzip"})
    assert r.status_code == 201, r.text
    (deployment_template,) = templates()
    assert _turn(a, "xia", "write from xia") == "1|from xia"
    r = a.post("/v1/agents/echo/users/xia/checkpoints", json={"name": "one"})
    assert r.status_code == 201, r.text
    ck = r.json()["id"]
    assert _turn(a, "xia", "write later") == "2|later"
    r = a.post(f"/v1/agents/echo/users/xia/checkpoints/{ck}/fork", json={"to_users": ["yan"]})
    assert r.status_code == 201, r.text
    (fork_template,) = templates() - {deployment_template}
    manifest = json.loads(raw.get_object(Bucket=s3_bucket, Key=f"{prefix}/templates/{fork_template}/snapshots/template.json")["Body"].read())
    assert manifest["meta"]["fork_of"]["user"] == "xia" and manifest["meta"]["image"]["digest"]
    # Yan is xia at checkpoint "one": her file, and the agent process's memory of that moment.
    assert _turn(a, "yan", "again") == "2|from xia"
    yan = hosts.record("yan").id
    r = a.post(f"/v1/sandboxes/{yan}/sleep")
    assert r.status_code == 200 and r.json()["slept"] is True, r.text

    # A host that never saw her wakes her: the fork template is fetched by id (made an overlay on the image).
    b = hosts.start("h2")
    assert _turn(b, "yan", "again") == "3|from xia"
    rec = hosts.record("yan")
    assert rec.host == "h2" and rec.meta["wake_kind"] == "snapshot" and rec.meta["resumed_from"]["from"] == "shipped"
    sbx = tmp_path / "h2" / "sandboxes"
    assert _backing(sbx / yan / "disk.qcow2") == str(sbx / ".templates" / fork_template / "disk.qcow2")

    # Xia is forgotten: nothing of her instance is left; the fork template stays while yan's VM needs it.
    xia = hosts.record("xia").id
    assert [k for k in keys() if f"/{xia}/" in k]
    r = b.delete("/v1/agents/echo/users/xia")
    assert r.status_code in (200, 204), r.text
    assert [k for k in keys() if xia in k] == []
    head = raw.head_object(Bucket=s3_bucket, Key=f"{prefix}/templates/{fork_template}/snapshots/template.json")
    # Past the grace, and several collections on both hosts later, the template yan's VM stands on is still there.
    time.sleep(max(8.0, head["LastModified"].timestamp() + GRACE_S + 8 - time.time()))
    assert fork_template in templates()
    assert _turn(b, "yan", "again") == "4|from xia"
    # Yan goes too: now nothing names the fork template, and it leaves the bucket.
    r = b.delete("/v1/agents/echo/users/yan")
    assert r.status_code in (200, 204), r.text
    until(lambda: templates() == {deployment_template}, "the fork template leaves the bucket", timeout_s=120)
    assert [k for k in keys() if k.startswith("instances/")] == []
    a.close()
    b.close()
