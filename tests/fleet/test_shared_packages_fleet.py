"""A process-driver agent with packages in a fleet: a user who wakes on another host binds that host's copy of the
template (fetched from the object store when the sandbox arrives), and what travels is the user's own files, not
the packages (docs/sandbox.md, *A template's shared directories*)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moorage.cli.up import tar_dir
from tests.fleet.harness import Fleet
from tests.runtime.test_shared_packages_up import index, write_agent  # noqa: F401 - the fixture


@pytest.fixture
def s3(seaweedfs, s3_bucket, tmp_path: Path) -> dict[str, str]:  # noqa: ANN001
    return seaweedfs.settings(s3_bucket, f"pkgs-{tmp_path.name}")


def test_a_user_wakes_on_another_host_binding_its_copy_of_the_template(tmp_path: Path, pg_url: str,
                                                                       s3: dict[str, str], index: str) -> None:  # noqa: F811
    # No prefetch: the template must come with the sandbox's arrival (``adopt_fetched``), the path this tests.
    f = Fleet(tmp_path, pg_url, s3, n=2, egress_allow_cidrs="127.0.0.0/8", egress_package_index=index,
              package_index_url=index + "/simple/", template_prefetch="0")
    try:
        r = f.api[0].post("/v1/agents/tab/deployments", content=tar_dir(write_agent(tmp_path)),
                          headers={"Content-Type": "application/gzip"})
        assert r.status_code == 201, r.text

        def say(i: int, user: str, text: str) -> str:
            r = f.api[i].post("/v1/agents/tab/invoke", json={"message": text, "user": user})
            assert r.status_code == 200, r.text
            return str(r.json()["reply"])

        assert say(0, "ann", "hello") == "hello  5"
        ann = f.records()["ann"].id
        r = f.api[0].post(f"/v1/sandboxes/{ann}/sleep")
        assert r.status_code == 200 and r.json()["slept"] is True, r.text
        assert not (f.hosts[1].data / "sandboxes" / ".templates").exists() or \
            not list((f.hosts[1].data / "sandboxes" / ".templates").iterdir())
        # Her next turn lands on h2: her sandbox comes from the object store, the template with it.
        assert say(1, "ann", "again") == "again  5"
        assert f.records()["ann"].host == "h2"
        sandbox = f.hosts[1].data / "sandboxes" / ann
        meta = json.loads((sandbox / "meta.json").read_text())
        template = Path(meta["shared"]["dir"])
        assert template.parent == f.hosts[1].data / "sandboxes" / ".templates"
        assert (template / "layer" / "work" / ".moorage" / "site" / "tabulate").is_dir()
        assert (template / "children" / ann).exists()
        assert list((sandbox / "layer" / "work" / ".moorage" / "site").iterdir()) == []
    finally:
        f.close()
