"""Before the data disk is full: `/metrics` says how much room is left, and the host's log warns while little is
(nothing did: the first sign was the 507 of a refused write)."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import httpx

from moorage.observability.disk import DiskWatch
from tests.diskfull.conftest import SmallDisk


def _gauge(text: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, text
    return float(m.group(1))


def test_metrics_show_the_data_disk_and_the_log_warns_while_it_is_nearly_full(host) -> None:  # type: ignore[no-untyped-def]
    up, disk = host
    up.start()
    token = (up.data / "api" / "metrics-token").read_text().strip()

    def scrape() -> str:
        r = httpx.get(f"{up.url}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=30)
        assert r.status_code == 200, r.text
        return r.text

    st = os.statvfs(disk.path)
    text = scrape()
    assert _gauge(text, "moorage_data_disk_size_bytes") == st.f_blocks * st.f_frsize == 32 << 20
    assert abs(_gauge(text, "moorage_data_disk_free_bytes") - st.f_bavail * st.f_frsize) < 1 << 20
    assert "data disk nearly full" not in up.log.read_text()
    up.stop()

    disk.leave(1 << 20)  # 1 MiB of 32 left: under 5%
    up.start()
    assert _gauge(scrape(), "moorage_data_disk_free_bytes") < 1 << 20
    said = up.log.read_text()
    assert "data disk nearly full" in said and "free_mib=" in said and "507 disk-full" in said, said[-3000:]


def test_the_warning_comes_once_and_room_again_is_said(tmp_path: Path) -> None:
    disk = SmallDisk(tmp_path / "d", 16)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("moorage.observability.disk")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        watch = DiskWatch(disk.path)
        assert not watch.check().nearly_full  # type: ignore[union-attr]
        disk.leave(256 << 10)
        for _ in range(3):
            assert watch.check().nearly_full  # type: ignore[union-attr]
        disk.free()
        assert not watch.check().nearly_full  # type: ignore[union-attr]
        said = [r.getMessage() for r in records]
        assert said == ["data disk nearly full", "data disk has room again"], said
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        disk.unmount()
