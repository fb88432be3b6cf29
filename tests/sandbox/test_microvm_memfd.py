"""Sealed template-RAM copies (microvm_memfd) without QEMU: exact size, holes kept, sealed for everyone, one copy per
file until it changes or is released. The QEMU side is in test_microvm.py."""

from __future__ import annotations

import fcntl
import mmap
import os
from pathlib import Path

import pytest

from moorage.sandbox import microvm_memfd as mm

MiB = 1 << 20


def _ram_file(path: Path, size: int = 8 * MiB) -> Path:
    with open(path, "wb") as f:
        f.truncate(size)
        f.seek(MiB)
        f.write(b"z" * 5000)  # two pages of data, the rest holes
        f.seek(6 * MiB)
        f.write(b"q" * 4096)
    return path


def _data_extents(fd: int) -> list[tuple[int, int]]:
    out, pos, size = [], 0, os.fstat(fd).st_size
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError:
            break
        end = os.lseek(fd, start, os.SEEK_HOLE)
        out.append((start, end))
        pos = end
    return out


def test_a_sealed_copy_has_the_files_bytes_size_and_holes_and_refuses_writes(tmp_path: Path) -> None:
    ram = _ram_file(tmp_path / "ram")
    try:
        e = mm.sealed_ram(ram)
        assert os.fstat(e.fd).st_size == 8 * MiB and e.copied_bytes == 3 * 4096
        assert _data_extents(e.fd) == [(MiB, MiB + 8192), (6 * MiB, 6 * MiB + 4096)]
        assert os.pread(e.fd, 8 * MiB, 0) == ram.read_bytes()
        assert fcntl.fcntl(e.fd, fcntl.F_GET_SEALS) == mm.SEALS
        fd = os.open(f"/proc/self/fd/{e.fd}", os.O_RDWR)  # re-opening read-write works, as QEMU does
        try:
            for attempt in (lambda: os.pwrite(fd, b"x", 0), lambda: os.ftruncate(fd, MiB),
                            lambda: mmap.mmap(fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE),
                            lambda: fcntl.fcntl(fd, fcntl.F_ADD_SEALS, 0)):
                with pytest.raises(PermissionError):
                    attempt()
            private = mmap.mmap(fd, 4096, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE, offset=MiB)
            private[:1] = b"x"
            assert os.pread(fd, 1, MiB) == b"z"
        finally:
            os.close(fd)
        assert mm.memfd_name(ram) == e.name and os.readlink(f"/proc/self/fd/{e.fd}") == f"/memfd:{e.name} (deleted)"
    finally:
        mm.release_under(tmp_path)


def test_one_copy_per_file_until_it_changes_goes_or_is_released(tmp_path: Path) -> None:
    a, b = _ram_file(tmp_path / "a"), _ram_file(tmp_path / "b")
    try:
        ea = mm.sealed_ram(a)
        assert mm.sealed_ram(a) is ea
        leased = mm.lease(a)
        assert leased != ea.fd and os.path.samestat(os.fstat(leased), os.fstat(ea.fd))
        os.close(leased)
        fd = mm.open_for_reading(a)  # the memfd, not the file
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
        os.close(fd)
        os.utime(a, ns=(1, 1))  # changed since: a new copy, and reads go to the file until then
        fd = mm.open_for_reading(a)
        assert os.readlink(f"/proc/self/fd/{fd}") == str(a.resolve())
        os.close(fd)
        assert mm.sealed_ram(a) is not ea
        a.unlink()  # gone: dropped when the next copy is made
        mm.sealed_ram(b)
        assert str(a.resolve()) not in mm.cached() and str(b.resolve()) in mm.cached()
        mm.release(b)
        assert str(b.resolve()) not in mm.cached()
    finally:
        mm.release_under(tmp_path)


def test_a_templates_ram_is_sealed_ahead_only_while_the_host_keeps_half_its_memory(tmp_path: Path,
                                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # A fleet host that fetched a template ahead of any wake makes its forks' sealed RAM copy then
    # (fleet/prefetch.py), unless that would leave less than half the host's memory available.
    from moorage.sandbox import microvm_templates

    tdir = tmp_path / "dep-x"
    tdir.mkdir()
    ram = _ram_file(tdir / "ram")
    try:
        monkeypatch.setattr(microvm_templates, "WARM_KEEPS_AVAILABLE", 1.0)  # nothing to spare
        assert microvm_templates.warm(tdir) is False and not mm.ready(ram)
        monkeypatch.setattr(microvm_templates, "WARM_KEEPS_AVAILABLE", 0.0)
        assert microvm_templates.warm(tdir) is True and mm.ready(ram)
        assert microvm_templates.warm(tdir) is False  # made already: nothing more
        (tdir / "deleted").touch()
        mm.release(ram)
        assert microvm_templates.warm(tdir) is False and not mm.ready(ram)  # a deleted template is left alone
    finally:
        mm.release(ram)
