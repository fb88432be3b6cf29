"""A turn's automatic checkpoint of a micro-VM writes its files behind the reply. When that write failed (here the
disk full) while the host ran on, the row stayed a turn checkpoint, a point to go back to, until the host's next
start (and only if it was still the instance's newest). It is marked ``missing`` at once, saying why."""

from __future__ import annotations

import io
import tarfile

from tests.diskfull.conftest import GZ, SmallDisk, vm_host  # noqa: F401 - fixture
from tests.lifecycle.crash_up import Up

#: Counts its turns in a file; ``grow`` also keeps 6 MiB of random bytes in its memory, which the turn's automatic
#: checkpoint then writes (incompressible) behind the reply.
AGENT = '''
import os

KEPT = []

async def on_message(ctx, message):
    if message == "grow":
        KEPT.append(os.urandom(6 << 20))
    try:
        n = int(ctx.files.read("counter.txt"))
    except Exception:
        n = 0
    ctx.files.write("counter.txt", str(n + 1))
    return f"{n + 1}: {message}"
'''


def archive() -> bytes:
    files = {"moorage.toml": '[agent]\nname = "echo"\nentry = "agent.py"\ndisk_mib = 64\n'
                             '[agent.lifecycle]\nusers = "auto"\n', "agent.py": AGENT}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    return buf.getvalue()


def test_an_automatic_checkpoint_whose_files_find_the_disk_full_is_missing_at_once(
        vm_host: tuple[Up, SmallDisk]) -> None:  # noqa: F811 - the fixture
    up, disk = vm_host
    up.start()
    with up.client() as c:
        assert c.post("/v1/agents/echo/deployments", content=archive(), headers=GZ).status_code == 201
        for n in (1, 2):
            assert c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"}).json()["reply"] == f"{n}: hi"
        assert [ck["kind"] for ck in c.get("/v1/agents/echo/users/ada/checkpoints").json()["data"]] == ["turn"] * 2
        sid = c.get("/v1/agents/echo/users/ada").json()["instance"]["sandbox_id"]
        assert c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["sync"]}).json()["exit_code"] == 0
        disk.leave(2 << 20)  # room for the pause's device state and the store, none for the memory pages
        assert c.post("/v1/agents/echo/invoke", json={"message": "grow", "user": "ada"}).json()["reply"] == "3: grow"
        latest, *before = c.get("/v1/agents/echo/users/ada/checkpoints").json()["data"]
        disk.free()
        log = up.log.read_text()
        assert "checkpoint not written" in log and "checkpoint after turn failed" not in log  # behind the reply
        assert latest["kind"] == "missing" and latest["restorable"] is False, latest
        assert "could not be written behind its turn" in latest["summary"]["error"], latest
        assert [ck["kind"] for ck in before] == ["turn"] * 2
        r = c.post(f"/v1/agents/echo/users/ada/checkpoints/{latest['id']}/rollback")
        assert r.status_code == 409, r.text
        assert c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"}).json()["reply"] == "4: hi"
        kinds = [ck["kind"] for ck in c.get("/v1/agents/echo/users/ada/checkpoints").json()["data"]]
        assert kinds == ["turn", "missing", "turn", "turn"], kinds
