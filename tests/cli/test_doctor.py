"""`moorage doctor`: one line per check, each with a fix when it fails; real QEMU, bubblewrap and store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

#: The guest images every test host shares: a data directory that links them reads the KVM verdict a probe left
#: there this host boot (on this host each probe waits out its 10 s timeout).
IMAGES_DIR = Path(os.environ.get("MOORAGE_TEST_IMAGES_DIR", "/var/tmp/moorage-images"))


def _data_dir(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    data.mkdir()
    (data / "images").symlink_to(IMAGES_DIR)
    return data


def test_doctor_reports_every_check(tmp_path: Path) -> None:
    env = {**os.environ, "MOORAGE_DATA_DIR": str(_data_dir(tmp_path))}
    made = subprocess.run([sys.executable, "-m", "moorage.cli.main", "store", "migrate"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    r = subprocess.run([sys.executable, "-m", "moorage.cli.main", "doctor", "--json"], env=env, capture_output=True,
                       text=True, timeout=900)
    checks = {c["name"]: c for c in json.loads(r.stdout)["data"]}
    assert set(checks) == {"qemu", "kvm", "bubblewrap", "disk", "store"}
    for c in checks.values():
        assert c["detail"], c
        if not c["ok"]:
            assert c["fix"], c  # a failed check always says what to do
    assert checks["qemu"]["ok"] and "QEMU emulator" in checks["qemu"]["detail"]
    assert checks["bubblewrap"]["ok"] and checks["disk"]["ok"]
    assert checks["store"]["ok"] and "sqlite" in checks["store"]["detail"]
    # KVM is judged by booting a guest, not by opening /dev/kvm: either verdict names what happened.
    kvm = checks["kvm"]
    assert ("boots a guest" in kvm["detail"]) if kvm["ok"] else kvm["optional"]
    # Only required checks decide the exit status.
    assert r.returncode == (0 if all(c["ok"] or c["optional"] for c in checks.values()) else 1)


def test_doctor_reports_an_unreachable_store_with_a_fix(tmp_path: Path) -> None:
    env = {**os.environ, "MOORAGE_DATA_DIR": str(_data_dir(tmp_path)),
           "MOORAGE_STORE_URL": "postgresql://nobody@127.0.0.1:1/none"}
    r = subprocess.run([sys.executable, "-m", "moorage.cli.main", "doctor", "--json"], env=env, capture_output=True,
                       text=True, timeout=900)
    store = {c["name"]: c for c in json.loads(r.stdout)["data"]}["store"]
    assert not store["ok"] and "MOORAGE_STORE_URL" in store["fix"]
    assert r.returncode == 1


def test_doctor_and_store_tenants_leave_a_fresh_data_dir_empty(tmp_path: Path) -> None:
    dirs = (tmp_path / "absent", tmp_path / "empty")
    dirs[1].mkdir()
    # Both at once: a fresh data directory has no probe verdict to read, so each doctor boots its own probe.
    doctors = [subprocess.Popen([sys.executable, "-m", "moorage.cli.main", "doctor", "--json"],
                                env={**os.environ, "MOORAGE_DATA_DIR": str(data)}, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True) for data in dirs]
    for data, doctor in zip(dirs, doctors):
        env = {**os.environ, "MOORAGE_DATA_DIR": str(data)}
        out, _ = doctor.communicate(timeout=900)
        store = {c["name"]: c for c in json.loads(out)["data"]}["store"]
        assert store["ok"] and f"no store yet at {data / 'store'}" in store["detail"], store
        assert "`moorage up`" in store["detail"]
        for args in (["store", "tenants"], ["store", "tenants", "--json"]):
            t = subprocess.run([sys.executable, "-m", "moorage.cli.main", *args], env=env, capture_output=True,
                               text=True, timeout=300)
            assert t.returncode == 0 and "no store yet" in t.stderr and "`moorage up`" in t.stderr, t
        assert json.loads(t.stdout) == {"data": []}
        assert (sorted(data.iterdir()) if data.exists() else None) == ([] if data.name == "empty" else None)
