"""`moorage doctor`: one line per check, each with a fix when it fails; real QEMU, bubblewrap and store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_doctor_reports_every_check(tmp_path: Path) -> None:
    env = {**os.environ, "MOORAGE_DATA_DIR": str(tmp_path / "data")}
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
    env = {**os.environ, "MOORAGE_DATA_DIR": str(tmp_path / "data"),
           "MOORAGE_STORE_URL": "postgresql://nobody@127.0.0.1:1/none"}
    r = subprocess.run([sys.executable, "-m", "moorage.cli.main", "doctor", "--json"], env=env, capture_output=True,
                       text=True, timeout=900)
    store = {c["name"]: c for c in json.loads(r.stdout)["data"]}["store"]
    assert not store["ok"] and "MOORAGE_STORE_URL" in store["fix"]
    assert r.returncode == 1


def test_doctor_and_store_tenants_leave_a_fresh_data_dir_empty(tmp_path: Path) -> None:
    for data in (tmp_path / "absent", tmp_path / "empty"):
        if data.name == "empty":
            data.mkdir()
        env = {**os.environ, "MOORAGE_DATA_DIR": str(data)}
        r = subprocess.run([sys.executable, "-m", "moorage.cli.main", "doctor", "--json"], env=env,
                           capture_output=True, text=True, timeout=900)
        store = {c["name"]: c for c in json.loads(r.stdout)["data"]}["store"]
        assert store["ok"] and f"no store yet at {data / 'store'}" in store["detail"], store
        assert "`moorage up`" in store["detail"]
        for args in (["store", "tenants"], ["store", "tenants", "--json"]):
            t = subprocess.run([sys.executable, "-m", "moorage.cli.main", *args], env=env, capture_output=True,
                               text=True, timeout=300)
            assert t.returncode == 0 and "no store yet" in t.stderr and "`moorage up`" in t.stderr, t
        assert json.loads(t.stdout) == {"data": []}
        assert (sorted(data.iterdir()) if data.exists() else None) == ([] if data.name == "empty" else None)
