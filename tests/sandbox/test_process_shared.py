"""A process template's shared directories (an agent's deploy-time packages): every fork reads the template's own
files, read-only, instead of a copy in its layer; the template stays while a fork binds it, a template made from a
fork carries them, and a fork that arrives on another host of a fleet binds that host's copy, fetched."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from moorage.config import Config
from moorage.errors import InvalidInput
from moorage.fleet.templates import PublishedTemplates
from moorage.objects.local import LocalObjectStore
from moorage.sandbox import SandboxNotFound
from moorage.sandbox.base import SandboxStateError, SnapshotCorrupt
from moorage.sandbox.process import ProcessDriver, ProcessSandbox

SITE = "/work/.moorage/site"
IMPORT = ["python3", "-c", f"import sys; sys.path.insert(0, '{SITE}'); import pkg; print(pkg.VALUE)"]
BLOB = 2_000_000


def _driver(root: Path) -> ProcessDriver:
    return ProcessDriver(root, Config(data_dir=root.parent / f"{root.name}-data"))


@pytest.fixture
async def pdriver(tmp_path: Path):
    d = _driver(tmp_path / "sandboxes")
    yield d
    await d.close()
    cleaner = _driver(tmp_path / "sandboxes")
    for sid in await cleaner.list():
        await (await cleaner.open(sid)).destroy()


async def _template(pdriver: ProcessDriver, tid: str = "tpl-a"):
    """A template whose /work/.moorage/site holds a package (and a 2 MB file) and whose /work holds app.txt."""
    b = await pdriver.create(f"builder-{tid}")
    await b.start()
    r = await b.exec(["sh", "-c", f"mkdir -p {SITE}/pkg && echo 'VALUE = 42' > {SITE}/pkg/__init__.py && "
                                  f"head -c {BLOB} /dev/urandom > {SITE}/pkg/blob && echo app > /work/app.txt"])
    assert r.exit_code == 0, r.stderr
    t = await pdriver.make_template(b, tid, shared=[SITE])
    await b.destroy()
    return t


async def test_forks_read_the_templates_shared_files_and_cannot_write_them(pdriver: ProcessDriver) -> None:
    t = await _template(pdriver)
    assert json.loads((Path(t.path) / "template.json").read_text())["shared"] == ["work/.moorage/site"]
    c1, c2 = await pdriver.fork(t, ["c1", "c2"])
    assert isinstance(c1, ProcessSandbox) and isinstance(c2, ProcessSandbox)
    for c in (c1, c2):
        await c.start()
        assert (await c.exec(IMPORT)).stdout.strip() == b"42"
    for cmd in (f"echo x > {SITE}/pkg/__init__.py", f"rm -rf {SITE}/pkg", f"touch {SITE}/new"):
        r = await c1.exec(["sh", "-c", cmd])
        assert r.exit_code != 0 and b"Read-only file system" in r.stderr, (cmd, r)
    # The rest of /work is each fork's own.
    await c1.write_file("/work/app.txt", b"c1's\n")
    assert await c2.read_file("/work/app.txt") == b"app\n"
    # On the host: each fork's layer holds an empty mount point, its disk and checkpoints none of the 2 MB.
    assert list((c1.layer / "work" / ".moorage" / "site").iterdir()) == []
    assert (await c1.stats()).disk_bytes < BLOB // 4
    assert (await c1.checkpoint("one")).bytes < BLOB // 4
    assert (Path(t.path) / "layer" / "work" / ".moorage" / "site" / "pkg" / "__init__.py").read_text() == "VALUE = 42\n"
    # Sleep and wake, and a rollback, bind it again.
    await c2.sleep()
    await c2.wake()
    assert (await c2.exec(["wc", "-c", f"{SITE}/pkg/blob"])).stdout.split()[0] == str(BLOB).encode()
    await c1.rollback("one")
    assert (await c1.exec(IMPORT)).stdout.strip() == b"42"


async def test_a_stopped_fork_binds_another_templates_shared_files(pdriver: ProcessDriver) -> None:
    """``bind_shared`` (a redeploy's packages for an existing instance): from the next start the fork binds the new
    template's directories, its own files kept, and no longer holds the old template, which then goes if deleted."""
    t1 = await _template(pdriver, "tpl-a")
    b = await pdriver.create("builder-b")
    await b.start()
    assert (await b.exec(["sh", "-c", f"mkdir -p {SITE}/pkg && echo 'VALUE = 43' > {SITE}/pkg/__init__.py"])).ok
    t2 = await pdriver.make_template(b, "tpl-b", shared=[SITE])
    await b.destroy()
    (c,) = await pdriver.fork(t1, ["c"])
    await c.start()
    await c.write_file("/work/mine.txt", b"mine\n")
    with pytest.raises(SandboxStateError):
        await pdriver.bind_shared(c, t2)  # a running fork keeps what it binds
    await c.stop()
    assert await pdriver.bind_shared(c, t2) == [SITE]
    await pdriver.delete_template(t1)
    assert not Path(t1.path).exists()  # its only fork binds it no more
    await c.start()
    assert (await c.exec(IMPORT)).stdout.strip() == b"43"
    assert await c.read_file("/work/mine.txt") == b"mine\n"
    # A template that shares nothing: the fork binds nothing from the next start.
    plain = await pdriver.make_template(await _bare(pdriver), "tpl-plain")
    await c.stop()
    assert await pdriver.bind_shared(c, plain) == []
    assert "shared" not in json.loads((c.dir / "meta.json").read_text())
    await c.start()
    assert (await c.exec(IMPORT)).exit_code != 0 and await c.read_file("/work/mine.txt") == b"mine\n"
    await c.checkpoint("unbound")
    # Back to one that shares, with a link to a host path where the mount point goes (the guest's doing): the link
    # is replaced by an empty directory, never followed.
    await c.stop()
    site = c.layer / "work" / ".moorage" / "site"
    site.rmdir()
    site.symlink_to(c.dir.parent.parent)
    assert await pdriver.bind_shared(c, t2) == [SITE]
    assert site.is_dir() and not site.is_symlink() and list(site.iterdir()) == []
    assert (c.dir.parent.parent).is_dir() and any(c.dir.parent.parent.iterdir())
    await c.start()
    assert (await c.exec(IMPORT)).stdout.strip() == b"43"
    # A rollback (in place, and of a stopped fork) to a checkpoint from before it bound them keeps what it binds now.
    await c.rollback("unbound")
    assert (await c.exec(IMPORT)).stdout.strip() == b"43"
    await c.stop()
    await c.rollback("unbound")
    await c.start()
    assert (await c.exec(IMPORT)).stdout.strip() == b"43"


async def _bare(pdriver: ProcessDriver) -> ProcessSandbox:
    b = await pdriver.create(f"bare-{len(await pdriver.list())}")
    await b.start()
    assert isinstance(b, ProcessSandbox)
    return b


async def test_a_deleted_template_stays_while_a_fork_binds_it_and_goes_with_the_last(pdriver: ProcessDriver) -> None:
    t = await _template(pdriver)
    c1, c2 = await pdriver.fork(t, ["c1", "c2"])
    await pdriver.delete_template(t)
    assert (Path(t.path) / "deleted").exists()
    with pytest.raises(SandboxNotFound, match="deleted"):
        await pdriver.fork(t, ["c3"])
    await c1.start()
    assert (await c1.exec(IMPORT)).stdout.strip() == b"42"
    await c1.destroy()
    assert Path(t.path).exists()
    await pdriver.delete_template(t)  # again (a collection does): c2 still binds it
    assert Path(t.path).exists()
    await c2.destroy()
    assert not Path(t.path).exists()
    # A fork whose directory went without its destroy (removed by hand) no longer holds it once its marker goes
    # (the host's template collection prunes such markers), and deleting again then removes it.
    t3 = await _template(pdriver, "tpl-c")
    (c3,) = await pdriver.fork(t3, ["c3"])
    await pdriver.delete_template(t3)
    shutil.rmtree(c3.dir)
    (Path(t3.path) / "children" / "c3").unlink()
    await pdriver.delete_template(t3)
    assert not Path(t3.path).exists()
    # Without forks, deleting removes it at once.
    t2 = await _template(pdriver, "tpl-b")
    await pdriver.delete_template(t2)
    assert not Path(t2.path).exists()


async def test_a_template_made_from_a_fork_carries_the_shared_files(pdriver: ProcessDriver) -> None:
    t = await _template(pdriver)
    (c1,) = await pdriver.fork(t, ["c1"])
    await c1.start()
    await c1.write_file("/work/mine.txt", b"c1's own\n")
    t2 = await pdriver.make_template(c1, "tpl-from-c1")
    assert json.loads((Path(t2.path) / "template.json").read_text())["shared"] == ["work/.moorage/site"]
    await c1.destroy()
    await pdriver.delete_template(t)
    assert not Path(t.path).exists()  # the new template does not depend on the old one
    (g,) = await pdriver.fork(t2, ["g"])
    await g.start()
    assert (await g.exec(IMPORT)).stdout.strip() == b"42"
    assert await g.read_file("/work/mine.txt") == b"c1's own\n"
    assert list((g.layer / "work" / ".moorage" / "site").iterdir()) == []


async def test_shared_paths_are_checked_and_a_refused_template_leaves_nothing(pdriver: ProcessDriver) -> None:
    b = await pdriver.create("builder")
    await b.start()
    await b.exec(["mkdir", "-p", "/work/a/b"])
    for bad in (["/etc"], ["/work/../etc"], ["/work"], ["work/a"], ["/work/a", "/work/a/b"],
                ["/work/missing"], ["/tmp/x"]):
        with pytest.raises(InvalidInput):
            await pdriver.make_template(b, "tpl-bad", shared=bad)
    assert not (pdriver.root / ".templates" / "tpl-bad").exists()
    assert not list((pdriver.root / ".templates").glob(".tpl-bad*"))


async def test_a_fork_that_arrives_on_another_host_binds_that_hosts_copy_fetched(pdriver: ProcessDriver,
                                                                                 tmp_path: Path) -> None:
    objects = LocalObjectStore(tmp_path / "bucket")
    t = await _template(pdriver)
    PublishedTemplates(objects, pdriver).publish(t, "dep-one")
    (c1,) = await pdriver.fork(t, ["c1"])
    await c1.start()
    await c1.write_file("/work/mine.txt", b"c1's own\n")
    await c1.sleep()
    other = _driver(tmp_path / "host-b")
    try:
        # What a fleet ships of a sleeping sandbox (``portable``), copied to the other host.
        shutil.copytree(c1.dir, other.root / "c1", ignore=lambda d, names: [n for n in names if d == str(c1.dir)
                                                                            and not other.portable(n)])
        with pytest.raises(SnapshotCorrupt, match="not on this host"):
            other.adopt_fetched("c1")
        other.template_source = PublishedTemplates(objects, other).fetch
        other.adopt_fetched("c1")
        assert (other.template_dir(t.id) / "children" / "c1").exists()
        moved = await other.open("c1")
        await moved.wake()
        assert (await moved.exec(IMPORT)).stdout.strip() == b"42"
        assert await moved.read_file("/work/mine.txt") == b"c1's own\n"
        await moved.destroy()
    finally:
        await other.close()


async def test_a_link_where_a_shared_directory_should_be_is_never_bound_or_written_through(pdriver: ProcessDriver,
                                                                                          tmp_path: Path) -> None:
    """A guest controls its layer: a symbolic link at a shared path (or on its way) could name any host path,
    which the root launcher would then bind into every fork, or a template made from the fork would write into."""
    host_dir = tmp_path / "host-secret"
    host_dir.mkdir()
    (host_dir / "key").write_text("host only")
    b = await pdriver.create("builder")
    await b.start()
    await b.exec(["sh", "-c", f"mkdir -p /work/.moorage && ln -s {host_dir} {SITE} && mkdir /work/x && "
                              f"ln -s {host_dir} /work/via && mkdir -p /work/x/y"])
    for bad in ([SITE], ["/work/via/y"]):
        with pytest.raises(InvalidInput, match="not a directory"):
            await pdriver.make_template(b, "tpl-link", shared=bad)
    # A fork that moves its mount point's parent away and leaves a link in its place: the template made from it
    # binds the files of the fork's own template, not the link's target, and writes nothing through it.
    t = await _template(pdriver)
    (c1,) = await pdriver.fork(t, ["c1"])
    await c1.start()
    r = await c1.exec(["sh", "-c", f"mv /work/.moorage /work/moved && mkdir /work/.moorage && "
                                   f"ln -s {host_dir} {SITE}"])
    assert r.exit_code == 0, r.stderr
    await c1.stop()
    assert (c1.layer / "work" / ".moorage" / "site").is_symlink()
    t2 = await pdriver.make_template(c1, "tpl-from-c1")
    site = Path(t2.path) / "layer" / "work" / ".moorage" / "site"
    assert not site.is_symlink() and (site / "pkg" / "__init__.py").read_text() == "VALUE = 42\n"
    assert sorted(p.name for p in host_dir.iterdir()) == ["key"]
    (g,) = await pdriver.fork(t2, ["g"])
    await g.start()
    assert (await g.exec(IMPORT)).stdout.strip() == b"42"
    assert (await g.exec(["cat", f"{SITE}/key"])).exit_code != 0
