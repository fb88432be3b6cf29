"""Deleting a whole tenant through ``moorage up`` and HTTP, beside deleting the same agents one by one.

One ``moorage up`` (process sandboxes, SQLite) and two tenants of the same shape: ``--agents`` echo agents, each
with ``--users`` end-users (``PUT /v1/agents/{a}/users/{u}``), ``--awake`` of them with an instance made by a turn.
Tenant ``gone`` is deleted whole by the operator (``DELETE /v1/tenants/gone``: keys revoked, every agent and user,
the store); tenant ``kept``'s agents are deleted one by one with its own key (``DELETE /v1/agents/{a}``), the
baseline of the same run. Afterwards ``gone`` is not listed and its key is refused.

    .venv/bin/python bench/api/tenant_delete.py [--agents 3] [--users 100] [--awake 5]

The last line printed is the headline.
"""

from __future__ import annotations

import argparse
import io
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
from moorage.devservices.fleet import LocalHost  # noqa: E402

AGENT = "async def on_message(ctx, message):\n    return message\n"


def archive(name: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for fname, text in (("moorage.toml", f'[agent]\nname = "{name}"\nentry = "agent.py"\n'), ("agent.py", AGENT)):
            data = text.encode()
            info = tarfile.TarInfo(fname)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def check(r: httpx.Response, *ok: int) -> httpx.Response:
    if r.status_code not in ok:
        raise SystemExit(f"{r.request.method} {r.request.url}: {r.status_code} {r.text[:300]}")
    return r


def fill(url: str, operator: str, tenant: str, agents: int, users: int, awake: int) -> tuple[str, list[str]]:
    """A tenant with its agents and users; returns its admin key and its agents' names."""
    with httpx.Client(base_url=url, timeout=120, headers={"authorization": f"Bearer {operator}"}) as op:
        key = check(op.post("/v1/tenants", json={"name": tenant}), 201).json()["api_key"]["secret"]
    names = [f"agent{i}" for i in range(agents)]
    with httpx.Client(base_url=url, timeout=120, headers={"authorization": f"Bearer {key}"}) as c:
        for name in names:
            check(c.post(f"/v1/agents/{name}/deployments", content=archive(name),
                         headers={"content-type": "application/gzip"}), 201)
            for u in range(users):
                check(c.put(f"/v1/agents/{name}/users/u{u}", json={}), 200, 201)
            for u in range(awake):
                check(c.post(f"/v1/agents/{name}/invoke", json={"message": "hi", "user": f"u{u}"}), 200)
    return key, names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=3)
    ap.add_argument("--users", type=int, default=100, help="end-users per agent")
    ap.add_argument("--awake", type=int, default=5, help="of them, per agent, with an instance (a turn each)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="moorage-bench-tenant-delete-") as tmp:
        host = LocalHost("up", Path(tmp) / "data", {})
        try:
            operator = (host.data / "api" / "operator-token").read_text().strip()
            gone_key, names = fill(host.url, operator, "gone", args.agents, args.users, args.awake)
            kept_key, _ = fill(host.url, operator, "kept", args.agents, args.users, args.awake)

            with httpx.Client(base_url=host.url, timeout=600, headers={"authorization": f"Bearer {operator}"}) as op:
                t0 = time.perf_counter()
                done = check(op.delete("/v1/tenants/gone"), 200).json()
                whole = time.perf_counter() - t0
                listed = [t["name"] for t in check(op.get("/v1/tenants"), 200).json()["data"]]
            with httpx.Client(base_url=host.url, timeout=600, headers={"authorization": f"Bearer {kept_key}"}) as c:
                t0 = time.perf_counter()
                for name in names:
                    check(c.delete(f"/v1/agents/{name}"), 200)
                one_by_one = time.perf_counter() - t0
            refused = httpx.get(f"{host.url}/v1/agents", headers={"authorization": f"Bearer {gone_key}"}).status_code
        finally:
            host.stop()
    users = args.agents * args.users
    assert done["agents"] == args.agents and done["users"] == users, done
    assert "gone" not in listed and "kept" in listed and refused == 401, (listed, refused)
    print(f"answer: {done}")
    print(f"tenant delete through moorage up: {args.agents} agents, {users} users "
          f"({args.agents * args.awake} with instances) {whole:.2f} s, {whole / users * 1000:.1f} ms/user; "
          f"baseline same run, the same agents of another tenant deleted one by one {one_by_one:.2f} s")


if __name__ == "__main__":
    main()
