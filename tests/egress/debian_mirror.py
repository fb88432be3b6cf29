"""A Debian mirror on disk for the tests and benchmarks of ``[agent] apt``: one-file packages built with dpkg-deb
(``/usr/bin/<name>`` prints a word), indexed as ``dists/bookworm/{Release, main/binary-amd64/Packages}`` and a
pool, unsigned (the operator's ``package_apt_trusted``). Serve ``root`` over HTTP; the mirror URL is
``http://<host>:<port>/debian``."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path


def _deb(build: Path, out_dir: Path, name: str, depends: str, says: str) -> Path:
    pkg = build / name
    (pkg / "DEBIAN").mkdir(parents=True)
    (pkg / "usr" / "bin").mkdir(parents=True)
    script = pkg / "usr" / "bin" / name
    script.write_text(f"#!/bin/sh\necho {says}\n")
    script.chmod(0o755)
    (pkg / "DEBIAN" / "control").write_text(f"Package: {name}\nVersion: 1.0\nArchitecture: all\n"
                                            + (f"Depends: {depends}\n" if depends else "") +
                                            "Maintainer: moorage tests <tests@moorage.invalid>\n"
                                            "Description: a canary for apt at deploy time\n")
    out = out_dir / f"{name}_1.0_all.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", str(pkg), str(out)], check=True, capture_output=True)
    return out


def build_mirror(root: Path, packages: dict[str, tuple[str, str]]) -> None:
    """``packages``: name -> (Depends field or "", the word its command prints)."""
    debian = root / "debian"
    index = b""
    for name, (depends, says) in sorted(packages.items()):
        pool = debian / "pool" / "main" / name[0] / name
        pool.mkdir(parents=True)
        deb = _deb(root / "build", pool, name, depends, says)
        data = deb.read_bytes()
        control = subprocess.run(["dpkg-deb", "-f", str(deb)], check=True, capture_output=True, text=True).stdout
        index += (control.rstrip("\n") + f"\nFilename: pool/main/{name[0]}/{name}/{deb.name}\nSize: {len(data)}\n"
                  f"SHA256: {hashlib.sha256(data).hexdigest()}\n\n").encode()
    binary = debian / "dists" / "bookworm" / "main" / "binary-amd64"
    binary.mkdir(parents=True)
    (binary / "Packages").write_bytes(index)
    (debian / "dists" / "bookworm" / "Release").write_text(
        "Origin: moorage-tests\nSuite: bookworm\nCodename: bookworm\nArchitectures: amd64 all\nComponents: main\n"
        "Date: Tue, 01 Dec 2026 00:00:00 UTC\nSHA256:\n"
        f" {hashlib.sha256(index).hexdigest()} {len(index)} main/binary-amd64/Packages\n")
