"""A PEP 503 package index on loopback serving LangGraph and its dependencies as wheels repacked from the
distributions installed in this venv (the sandbox's Python is the same 3.11 on the same architecture, so the
binary ones fit it too). No network: pip in the sandbox installs from here through the egress gateway."""

from __future__ import annotations

import base64
import functools
import hashlib
import http.server
import importlib.metadata as md
import re
import threading
import zipfile
from pathlib import Path
from typing import Iterator

from packaging.requirements import Requirement

#: Files of an installed distribution that are not part of its wheel (pip writes them at install time).
_INSTALL_ONLY = ("INSTALLER", "REQUESTED", "direct_url.json", "RECORD")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(*roots: str) -> list[md.Distribution]:
    """The installed distributions ``roots`` need (their requirements without extras, for this Python)."""
    seen: dict[str, md.Distribution] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        if _norm(name) in seen:
            continue
        dist = md.distribution(name)
        seen[_norm(name)] = dist
        for raw in dist.requires or ():
            req = Requirement(raw)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return sorted(seen.values(), key=lambda d: _norm(d.metadata["Name"]))


def _digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def repack(dist: md.Distribution, out_dir: Path) -> Path:
    """A wheel of an installed distribution: its files under site-packages, its dist-info and a RECORD of them.
    Scripts outside site-packages (``../../bin``) are left out; nothing here needs them. Compressed, as PyPI's
    are: a micro-VM's pip downloads them through the channel's relay (zstandard: 24 MB stored, 5.6 MB deflated)."""
    wheel_meta = dist.read_text("WHEEL") or ""
    tags = [l.split(":", 1)[1].strip() for l in wheel_meta.splitlines() if l.startswith("Tag:")]
    name = re.sub(r"[-_.]+", "_", dist.metadata["Name"])
    # The compressed tag set of the file name (PEP 425): e.g. py2.py3-none-any, cp311-cp311-manylinux_….manylinux2014_….
    parts = [list(dict.fromkeys(t.split("-")[i] for t in tags)) for i in range(3)] if tags else [["py3"], ["none"], ["any"]]
    out = out_dir / f"{name}-{dist.version}-{'-'.join('.'.join(p) for p in parts)}.whl"
    record, info_dir = [], None
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for f in dist.files or ():
            rel = str(f)
            if rel.startswith("..") or "__pycache__" in rel:
                continue
            top, _, base = rel.partition("/")
            if top.endswith(".dist-info"):
                info_dir = top
                if base in _INSTALL_ONLY:
                    continue
            path = Path(f.locate())
            if not path.is_file():
                continue
            data = path.read_bytes()
            z.writestr(rel, data)
            record.append(f"{rel},{_digest(data)},{len(data)}")
        assert info_dir is not None, dist.metadata["Name"]
        record.append(f"{info_dir}/RECORD,,")
        z.writestr(f"{info_dir}/RECORD", "\n".join(record) + "\n")
    return out


def build_index(root: Path, *roots: str) -> list[str]:
    """``root/simple/<name>/index.html`` linking one wheel each; returns the project names."""
    names = []
    for dist in closure(*roots):
        wheel = repack(dist, root)
        project = _norm(dist.metadata["Name"])
        (root / "simple" / project).mkdir(parents=True, exist_ok=True)
        (root / "simple" / project / "index.html").write_text(f'<a href="../../{wheel.name}">{wheel.name}</a>\n')
        names.append(project)
    (root / "simple" / "index.html").write_text("".join(f'<a href="{n}/">{n}</a>\n' for n in names))
    return names


def serve(root: Path, host: str = "127.0.0.1") -> Iterator[int]:
    """Serve ``root`` on a loopback port until the generator is closed (``host``: another loopback address, e.g.
    127.0.0.2, which a sandbox's pip reaches through its proxy: it goes direct to 127.0.0.1)."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *a: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer((host, 0), functools.partial(Quiet, directory=str(root)))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield srv.server_address[1]
    finally:
        srv.shutdown()
