"""A hostile deployer uploads decompression bombs and archives full of links, devices and entries: each is
refused from the tar headers, before its data is read, and host memory stays within a stated bound.
"""

from __future__ import annotations

import io
import tarfile
import zlib

import pytest

from moorage.runtime.package import MAX_ENTRIES, MAX_PACKAGE_BYTES, AgentPackageError, load_archive, unpack
from tests.attacks.api_support import MIB, peak_rss_growth

#: Peak host memory an attack archive may add while it is refused.
RSS_BOUND = 50 * MIB
MANIFEST = b'[agent]\nname = "bomb"\nsystem_prompt = "hi"\n'


def _gzip_tar(parts: list[tuple[tarfile.TarInfo, int]]) -> bytes:
    """A tar.gz of members whose data is ``size`` zero bytes each, compressed as it is produced (never held)."""
    z = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    out: list[bytes] = []
    manifest = tarfile.TarInfo("moorage.toml")
    manifest.size = len(MANIFEST)
    out.append(z.compress(manifest.tobuf(tarfile.GNU_FORMAT) + MANIFEST + b"\0" * (-len(MANIFEST) % 512)))
    zeros = bytes(MIB)
    for info, size in parts:
        out.append(z.compress(info.tobuf(tarfile.GNU_FORMAT)))
        left = size + (-size % 512)
        while left:
            n = min(left, len(zeros))
            out.append(z.compress(zeros[:n]))
            left -= n
    out.append(z.compress(b"\0" * 1024) + z.flush())
    return b"".join(out)


def _member(name: str, size: int = 0, kind: bytes = tarfile.REGTYPE, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.type, info.linkname = size, kind, linkname
    return info


def test_a_300_mib_file_in_a_small_gzip_is_refused_unread() -> None:
    bomb = _gzip_tar([(_member("big.bin", 300 * MIB), 300 * MIB)])
    assert len(bomb) < MAX_PACKAGE_BYTES // 20  # ~300 KB on the wire
    with peak_rss_growth() as growth:
        with pytest.raises(AgentPackageError, match="unpacks to more than"):
            load_archive(bomb)
    assert growth.bytes < RSS_BOUND, f"host memory grew {growth.bytes >> 20} MiB"


def test_many_small_files_adding_up_past_the_limit_are_refused() -> None:
    parts = [(_member(f"f{i}.bin", 3 * MIB), 3 * MIB) for i in range(40)]  # 120 MiB in 3 MiB pieces
    with peak_rss_growth() as growth:
        with pytest.raises(AgentPackageError, match="unpacks to more than"):
            unpack(_gzip_tar(parts))
    assert growth.bytes < RSS_BOUND


def test_a_header_record_claiming_200_mib_is_cut_off_while_streaming() -> None:
    """GNU long-name records are read whole by tarfile: the bounded stream stops them, not the header check."""
    longname = _member("././@LongLink", 200 * MIB, tarfile.GNUTYPE_LONGNAME)
    with peak_rss_growth() as growth:
        with pytest.raises(AgentPackageError, match="too much data"):
            unpack(_gzip_tar([(longname, 200 * MIB)]))
    assert growth.bytes < RSS_BOUND, f"host memory grew {growth.bytes >> 20} MiB"


def test_every_entry_counts_directories_included() -> None:
    dirs = [(_member(f"d{i}", 0, tarfile.DIRTYPE), 0) for i in range(MAX_ENTRIES + 1)]
    with pytest.raises(AgentPackageError, match="files"):
        unpack(_gzip_tar(dirs))


@pytest.mark.parametrize("kind,linkname", [
    (tarfile.SYMTYPE, "/etc/passwd"), (tarfile.LNKTYPE, "moorage.toml"), (tarfile.CHRTYPE, ""),
    (tarfile.BLKTYPE, ""), (tarfile.FIFOTYPE, ""),
])
def test_links_devices_and_fifos_are_refused(kind: bytes, linkname: str) -> None:
    with pytest.raises(AgentPackageError, match="not a regular file"):
        unpack(_gzip_tar([(_member("agent.py", 0, kind, linkname), 0)]))


@pytest.mark.parametrize("name", ["../escape.py", "/abs.py", "a/../../b.py", "dir\\..\\x.py"])
def test_paths_that_escape_are_refused(name: str) -> None:
    with pytest.raises(AgentPackageError, match="unsafe path"):
        unpack(_gzip_tar([(_member(name, 4), 4)]))


def test_an_honest_package_still_unpacks() -> None:
    files = unpack(_gzip_tar([(_member("agent.py", 10), 10), (_member("lib", 0, tarfile.DIRTYPE), 0)]))
    assert files["moorage.toml"] == MANIFEST and files["agent.py"] == bytes(10)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:  # an uncompressed tar is accepted too
        info = tarfile.TarInfo("moorage.toml")
        info.size = len(MANIFEST)
        tar.addfile(info, io.BytesIO(MANIFEST))
    assert load_archive(buf.getvalue()).name == "bomb"
