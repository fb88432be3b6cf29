"""`moorage backup DEST` while `moorage up` runs (docs/operations.md, "Online backup"): the host keeps serving turns
of several users while it copies them, and a host started on the copy has every user at one point of their own
(their files and their memory agree); a DEST that exists is refused, and a backup whose host died is marked
incomplete and refused by `moorage up`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest

from moorage.client.sync import Client
from moorage.devservices.counter_agent import AGENT_PY, write_counter_agent
from moorage.devservices.fleet import LocalHost

ROOT = Path(__file__).resolve().parents[2]
USERS = [f"u{i}" for i in range(6)]
ENV = {"MOORAGE_LOG_LEVEL": "warning"}


def agent_dir(tmp_path: Path) -> Path:
    # Retention keeps only the newest two checkpoints: a backup's point must outlive the turns after it.
    return write_counter_agent(tmp_path / "agents", toml='[agent.timetravel]\nkeep = 2\ndaily = 0\n')


def backup_env(data: Path) -> dict[str, str]:
    # The data directory in the environment, not the command line: a killed host's processes are found by it.
    return {**os.environ, "MOORAGE_DATA_DIR": str(data), "MOORAGE_SANDBOX_DRIVER": "process"}


def backup_cmd(dest: Path) -> list[str]:
    return [sys.executable, "-m", "moorage.cli.main", "backup", str(dest)]


def backup(data: Path, dest: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(backup_cmd(dest), env=backup_env(data), capture_output=True, text=True, timeout=600,
                          cwd=ROOT)


def turns_recorded(sdk: Client, user: str) -> list[int]:
    events, cursor = [], None
    while True:
        page = sdk.list_events("counter", user, limit=500, cursor=cursor)
        events += page["data"]
        cursor = page["next_cursor"]
        if not cursor:
            break
    return sorted(int(e["content"].split()[1]) for e in events if str(e.get("content", "")).startswith("turn "))


def every(page_of: Callable[[str | None], Any]) -> list[Any]:
    """Every item of a paged listing: ``page_of(cursor)`` is one page."""
    items, cursor = [], None
    while True:
        page = page_of(cursor)
        items += page["data"]
        if not (cursor := page["next_cursor"]):
            return items


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else float("nan")


class Load:
    """Each user sends turns one after another until stopped; every latency and failure is kept."""

    def __init__(self, host: LocalHost) -> None:
        self.host, self.stop = host, threading.Event()
        self.lat: list[tuple[float, float]] = []  # (start, seconds)
        self.errors: list[str] = []
        self.done = {u: 0 for u in USERS}
        self.threads = [threading.Thread(target=self._user, args=(u,)) for u in USERS]

    def _user(self, user: str) -> None:
        with httpx.Client(base_url=self.host.url, headers={"Authorization": f"Bearer {self.host.key}"},
                          timeout=120) as http:
            while not self.stop.is_set():
                t0 = time.time()
                r = http.post("/v1/agents/counter/invoke", json={"user": user, "message": "go"})
                if r.status_code != 200:
                    self.errors.append(f"{user}: {r.status_code} {r.text[:300]}")
                    continue
                self.lat.append((t0, time.time() - t0))
                self.done[user] = int(r.json()["reply"].split(":")[0])

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=180)

    def between(self, a: float, b: float) -> list[float]:
        return [s for t0, s in self.lat if a <= t0 < b]


def test_online_backup_under_load_restores_every_user_at_one_point(tmp_path: Path) -> None:
    data, dest = tmp_path / "a" / "data", tmp_path / "backup"
    host = LocalHost("box", data, ENV, start_timeout_s=300)
    try:
        with Client(host.url, host.key) as sdk:
            sdk.deploy("counter", agent_dir(tmp_path))
            for u in ["slow", *USERS]:  # every user has an instance before the load; "slow"'s is the oldest
                assert sdk.invoke("counter", "hello", user=u)["reply"] == "1: hello"
        # slow is in an 8 s turn when the backup begins: it copies the others first and then waits for that turn,
        # while they take many turns; their backup points must outlive retention (which keeps two checkpoints)
        # until the store is copied.
        slow = threading.Thread(target=lambda: httpx.post(
            f"{host.url}/v1/agents/counter/invoke", json={"user": "slow", "message": "slow8"},
            headers={"Authorization": f"Bearer {host.key}"}, timeout=120))
        with Load(host) as load:
            time.sleep(4)
            t_base = time.time()
            time.sleep(4)
            before = dict(load.done)
            slow.start()
            time.sleep(0.5)
            t0 = time.time()
            r = backup(data, dest)
            t1 = time.time()
            time.sleep(2)
            after = dict(load.done)
        slow.join(timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        # The running host's record of where it serves is its own: a copy of it sent the copy's clients (its admin
        # key) to this host for as long as it runs.
        assert (data / "moorage-up.json").exists() and not (dest / "moorage-up.json").exists()
        assert "(online: " in r.stdout and f"{len(USERS) + 1}/{len(USERS) + 1} user:counter/" in r.stdout, r.stdout
        # The host kept serving: every turn of the load succeeded, during the backup too.
        assert not load.errors, load.errors[:5]
        during = load.between(t0, t1)
        assert during and all(after[u] > before[u] for u in USERS), (before, after)
        print(f"\nonline backup of {len(USERS)} users under load: {t1 - t0:.2f} s (CLI included); turns p99 "
              f"{p99(load.between(t_base, t0)) * 1000:.0f} ms before, {p99(during) * 1000:.0f} ms during "
              f"({len(during)} turns)")
        assert not (dest / "moorage-backup.incomplete").exists()
        manifest = json.loads((dest / "moorage-backup.json").read_text())
        assert sorted(i["scope"] for i in manifest["instances"]) == sorted(f"user:counter/{u}" for u in
                                                                           ["slow", *USERS])
        assert manifest["instances"][-1]["scope"] == "user:counter/slow"  # its turn did not hold the others up
        assert all(i["point"] == "checkpoint" for i in manifest["instances"]) and not manifest["left_out"]
        # On the running host slow's backup point (no turn since) is listed, unnamed now, and refused as a
        # rollback target (its sandbox half is only in the backup).
        with Client(host.url, host.key) as sdk:
            cks = sdk.list_checkpoints("counter", "slow", limit=500)["data"]
            (point,) = [c for c in cks if c["summary"].get("backup") == manifest["backup"]]
            assert point["restorable"] is False and point["name"] is None
            refused = httpx.post(f"{host.url}/v1/agents/counter/users/slow/checkpoints/{point['id']}/rollback",
                                 headers={"Authorization": f"Bearer {host.key}"}, timeout=60)
            assert refused.status_code == 409 and "checkpoint-gone" in refused.text, refused.text
    finally:
        host.stop()

    # The copy on "another machine" (the original gone): every user answers, files and memory at one point.
    (data.parent).rename(tmp_path / "gone")
    restored = LocalHost("elsewhere", dest, ENV, start_timeout_s=300)
    try:
        with Client(restored.url, restored.key) as sdk:
            assert turns_recorded(sdk, "slow") == [1, 2]  # its slow turn ended before it was copied
            for u in USERS:
                recorded = turns_recorded(sdk, u)
                n = len(recorded)
                assert recorded == list(range(1, n + 1)), (u, recorded)
                assert before[u] <= n <= after[u], (u, before[u], n, after[u])
                # The files say the same: the next turn is the one after the last the memory holds.
                assert sdk.invoke("counter", "again", user=u)["reply"] == f"{n + 1}: again", u
    finally:
        restored.stop()


class Arrivals:
    """New users arrive one after another until stopped: first turns (two turns each), users made with
    ``PUT ?provision=true``, and forks of ``src`` into new users; when each was made, and every failure, kept."""

    def __init__(self, host: LocalHost, checkpoint: str) -> None:
        self.host, self.checkpoint, self.stop = host, checkpoint, threading.Event()
        self.made: list[tuple[float, str]] = []
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(kind, f"{kind}{n}-"))
                        for kind, n in [("new", 0), ("new", 1), ("new", 2), ("put", 0), ("fork", 0)]]

    def _run(self, kind: str, prefix: str) -> None:
        i = 0
        with Client(self.host.url, self.host.key, timeout_s=120) as sdk:
            while not self.stop.is_set():
                user, i = f"{prefix}{i}", i + 1
                try:
                    if kind == "new":
                        sdk.invoke("counter", "go", user=user)
                        self.made.append((time.time(), user))
                        sdk.invoke("counter", "go", user=user)
                    elif kind == "put":
                        sdk.put_user("counter", user, provision=True)
                        self.made.append((time.time(), user))
                    else:
                        sdk.fork_checkpoint("counter", "src", self.checkpoint, user)
                        self.made.append((time.time(), user))
                except Exception as e:  # noqa: BLE001 - every failure is reported by the test
                    self.errors.append(f"{user}: {e}")

    def __enter__(self) -> "Arrivals":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=180)


def test_online_backup_while_new_users_arrive_has_every_user_with_their_instance(tmp_path: Path) -> None:
    """Users made while the backup runs (first turns, PUT ?provision=true, forks): in a host started on the copy
    every user's memory and files agree (the next turn counts on from what the memory holds) and every instance
    belongs to a user of the copy. Such a user's instance was left out of the copy while their rows were in it
    (their memory said turn 2, their files nothing)."""
    data, dest = tmp_path / "a" / "data", tmp_path / "backup"
    host = LocalHost("box", data, ENV, start_timeout_s=300)
    try:
        with Client(host.url, host.key) as sdk:
            sdk.deploy("counter", agent_dir(tmp_path))
            for u in [*USERS, "src", "src"]:
                sdk.invoke("counter", "hello", user=u)
            newest = sdk.list_checkpoints("counter", "src", limit=1)["data"][0]["id"]
        with Load(host) as load, Arrivals(host, newest) as arrivals:
            time.sleep(3)
            t0 = time.time()
            r = backup(data, dest)
            t1 = time.time()
            time.sleep(1)
        assert r.returncode == 0, r.stdout + r.stderr
        assert not load.errors and not arrivals.errors, (load.errors[:3], arrivals.errors[:3])
        during = [u for t, u in arrivals.made if t0 <= t < t1]
        assert {u.rstrip("0123456789-") for u in during} == {"new", "put", "fork"}, during  # each kind of arrival, while it ran
        manifest = json.loads((dest / "moorage-backup.json").read_text())
        print(f"\n{len(during)} users made during the backup ({t1 - t0:.1f} s); copied "
              f"{len(manifest['instances'])}, left out {manifest['left_out']}; {manifest['phases']}")
    finally:
        host.stop()

    restored = LocalHost("elsewhere", dest, ENV, start_timeout_s=300)
    try:
        with Client(restored.url, restored.key, timeout_s=120) as sdk:
            users = [u["id"] for u in every(lambda c: sdk.list_users("counter", limit=500, cursor=c))]
            boxes = every(lambda c: sdk.list_sandboxes(agent="counter", limit=500, cursor=c))
            assert {b["scope"] for b in boxes} <= {f"user:counter/{u}" for u in users}, "an instance without its user"
            assert {u for t, u in arrivals.made if t < t0} <= set(users)
            for u in users:
                n = len(recorded := turns_recorded(sdk, u))
                assert recorded == list(range(1, n + 1)), (u, recorded)
                assert sdk.invoke("counter", "again", user=u)["reply"] == f"{n + 1}: again", (u, recorded)
    finally:
        restored.stop()


def test_a_user_forgotten_after_their_instance_was_copied_is_not_in_the_copy(tmp_path: Path) -> None:
    """ada is copied, then forgotten while the backup waits for slow's long turn (before the tenant's store is
    copied): the backup finishes and its copy has neither her rows nor her instance's directory. The backup
    failed ('could not be put back to its point': her backup checkpoint was forgotten with her)."""
    data, dest = tmp_path / "a" / "data", tmp_path / "backup"
    host = LocalHost("box", data, ENV, start_timeout_s=300)
    try:
        with Client(host.url, host.key) as sdk:
            sdk.deploy("counter", agent_dir(tmp_path))
            for u in ["slow", "ada", "bob"]:
                assert sdk.invoke("counter", "hello", user=u)["reply"] == "1: hello"
            ada_box = sdk.get_user("counter", "ada")["instance"]["sandbox_id"]
        slow = threading.Thread(target=lambda: httpx.post(
            f"{host.url}/v1/agents/counter/invoke", json={"user": "slow", "message": "slow8"},
            headers={"Authorization": f"Bearer {host.key}"}, timeout=120))
        slow.start()
        deadline = time.monotonic() + 60
        with Client(host.url, host.key) as sdk:
            while not [r for r in sdk.list_workflows(status="running", agent="counter")["data"]
                       if r["scope"].split("/")[1] == "slow"]:
                assert time.monotonic() < deadline, "slow's turn never began"
                time.sleep(0.1)
        cli = subprocess.Popen(backup_cmd(dest), env=backup_env(data), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd=ROOT)
        assert cli.stdout is not None
        for line in cli.stdout:  # slow's turn is waited for after the others are copied
            if line.strip().startswith("2/3 "):
                break
        with Client(host.url, host.key) as sdk:
            sdk.delete_user("counter", "ada")
        out, err = cli.communicate(timeout=120)
        slow.join(timeout=60)
        assert cli.returncode == 0, out + err
        manifest = json.loads((dest / "moorage-backup.json").read_text())
        assert sorted(i["scope"] for i in manifest["instances"]) == ["user:counter/bob", "user:counter/slow"]
        assert [(x["scope"], x["why"]) for x in manifest["left_out"]] == \
            [("user:counter/ada", "deleted, or its user forgotten, after it was copied")]
        assert not (dest / "sandboxes" / ada_box).exists()
    finally:
        host.stop()
    restored = LocalHost("elsewhere", dest, ENV, start_timeout_s=300)
    try:
        with Client(restored.url, restored.key) as sdk:
            assert sorted(u["id"] for u in sdk.list_users("counter")["data"]) == ["bob", "slow"]
            assert sorted(b["scope"] for b in sdk.list_sandboxes(agent="counter")["data"]) == \
                ["user:counter/bob", "user:counter/slow"]
            assert sdk.invoke("counter", "again", user="bob")["reply"] == "2: again"
    finally:
        restored.stop()


def test_online_backup_refuses_an_existing_dest_and_a_killed_one_is_marked_incomplete(tmp_path: Path) -> None:
    data = tmp_path / "a" / "data"
    host = LocalHost("box", data, ENV, start_timeout_s=300)
    killed = False
    try:
        with Client(host.url, host.key) as sdk:
            sdk.deploy("counter", agent_dir(tmp_path))
            assert sdk.invoke("counter", "hello", user="ada")["reply"] == "1: hello"
        (tmp_path / "taken").mkdir()
        r = backup(data, tmp_path / "taken")
        assert r.returncode == 2 and "already exists" in r.stderr, r.stderr
        r = backup(data, tmp_path / "no-such-dir" / "b")  # refused by the host, reported by the CLI
        assert r.returncode == 2 and "no-such-dir is not a directory" in r.stderr, r.stderr
        assert not (tmp_path / "no-such-dir").exists()

        # A turn that runs 25 s: the backup waits for it, and the host dies meanwhile.
        def slow_turn() -> None:
            try:
                httpx.post(f"{host.url}/v1/agents/counter/invoke", json={"user": "ada", "message": "slow"},
                           headers={"Authorization": f"Bearer {host.key}"}, timeout=120)
            except httpx.HTTPError:
                pass  # the host is killed under it

        slow = threading.Thread(target=slow_turn)
        slow.start()
        time.sleep(2)
        dest = tmp_path / "cut"
        cli = subprocess.Popen(backup_cmd(dest), env=backup_env(data), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        assert cli.stdout is not None
        assert "online backup of" in cli.stdout.readline()
        time.sleep(1)
        host.kill()
        killed = True
        out, err = cli.communicate(timeout=60)
        slow.join(timeout=60)
        assert cli.returncode == 2 and "incomplete" in err, out + err
        assert (dest / "moorage-backup.incomplete").exists() and not (dest / "moorage-backup.json").exists()
    finally:
        if not killed:
            host.kill()
    # Not restorable by accident: moorage up refuses to serve it.
    proc = subprocess.run([sys.executable, "-m", "moorage.cli.main", "--data-dir", str(dest), "up"],
                          env={**os.environ, "MOORAGE_SANDBOX_DRIVER": "process", "MOORAGE_PORT": "1"},
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0 and "did not finish" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


VM_AGENT_PY = '''
SEEN = 0  # in the guest's memory only: it goes on counting only if the VM's RAM was restored


async def on_message(ctx, message):
    global SEEN
    SEEN += 1
    try:
        n = int(ctx.files.read("counter.txt"))
    except Exception:
        n = 0
    await ctx.memory.remember(f"turn {n + 1}")
    ctx.files.write("counter.txt", str(n + 1))
    return f"{n + 1} {SEEN}"
'''


@pytest.mark.slow
def test_online_backup_of_micro_vms_restores_their_memory_files_and_store_at_one_point(tmp_path: Path) -> None:
    data, dest = tmp_path / "a" / "data", tmp_path / "backup"
    env = {**ENV, "MOORAGE_TEST_IMAGES_DIR": os.environ.get("MOORAGE_TEST_IMAGES_DIR", "/var/tmp/moorage-images")}
    agent = tmp_path / "agents" / "counter"
    agent.mkdir(parents=True)
    (agent / "moorage.toml").write_text('[agent]\nname = "counter"\nentry = "agent.py"\n'
                                        '[agent.lifecycle]\nusers = "auto"\nsleep = "fixed:3600"\n')
    (agent / "agent.py").write_text(VM_AGENT_PY)
    host = LocalHost("box", data, env, driver="microvm")
    errors: list[str] = []
    replies: dict[str, int] = {"ada": 0, "bob": 0}
    try:
        with Client(host.url, host.key) as sdk:
            sdk.deploy("counter", agent)
            for u in replies:
                assert sdk.invoke("counter", "hello", user=u)["reply"] == "1 1"
        stop = threading.Event()

        def turns(user: str) -> None:  # both VMs awake and taking turns while the backup runs
            with Client(host.url, host.key) as sdk:
                while not stop.is_set():
                    try:
                        replies[user] = int(sdk.invoke("counter", "go", user=user)["reply"].split()[0])
                    except Exception as e:  # noqa: BLE001 - every failure is reported below
                        errors.append(f"{user}: {e}")

        threads = [threading.Thread(target=turns, args=(u,)) for u in replies]
        for t in threads:
            t.start()
        time.sleep(2)
        before = dict(replies)
        r = backup(data, dest)
        time.sleep(2)
        stop.set()
        for t in threads:
            t.join(timeout=300)
        after = dict(replies)
        assert r.returncode == 0 and "(online: 2 instance(s)" in r.stdout, r.stdout + r.stderr
        print(f"\n{r.stdout.splitlines()[-1]}")
        assert not errors, errors[:3]
        assert all(after[u] > before[u] for u in replies), (before, after)
        # The booted template the deploy's builder kept (a cache of a boot) is not copied; the deployment's is.
        booted = [p.name for p in (data / "sandboxes" / ".templates").iterdir() if p.name.startswith("boot-")]
        assert booted and list((data / "templates" / "booted").glob("*.json")), booted
        kept = {p.name for p in (dest / "sandboxes" / ".templates").iterdir()}
        assert kept and not kept & set(booted), (kept, booted)
        assert not (dest / "templates" / "booted").exists()
        assert oct((dest / "sandboxes" / ".templates").stat().st_mode & 0o777) == \
            oct((data / "sandboxes" / ".templates").stat().st_mode & 0o777)
    finally:
        host.stop()
    # Stopped, the host's data directory is copied under its lock, and the booted templates are left out there too.
    stopped = backup(data, tmp_path / "stopped")
    assert stopped.returncode == 0 and "(online" not in stopped.stdout, stopped.stdout + stopped.stderr
    assert not (tmp_path / "stopped" / "templates" / "booted").exists()
    assert {p.name for p in (tmp_path / "stopped" / "sandboxes" / ".templates").iterdir()} == kept

    restored = LocalHost("elsewhere", dest, env, driver="microvm")
    try:
        with Client(restored.url, restored.key) as sdk:
            for u in replies:
                n = len(turns_recorded(sdk, u))
                assert turns_recorded(sdk, u) == list(range(1, n + 1)) and before[u] <= n <= after[u], (u, n)
                # Files, the store and the VM's RAM (SEEN: turns since this VM booted, 1 for "hello") agree.
                assert sdk.invoke("counter", "again", user=u)["reply"] == f"{n + 1} {n + 1}", u
                boxes = {s["scope"]: s for s in sdk.list_sandboxes(agent="counter")["data"]}
                assert boxes[f"user:counter/{u}"]["wake_kind"] == "snapshot"
    finally:
        restored.stop()


def test_online_backup_holds_a_per_session_instance_until_its_store_is_copied(tmp_path: Path) -> None:
    """An instance with no per-user checkpoint (one per session) stays held from its copy until its tenant's store
    is copied: turns sent meanwhile wait and succeed, and the copy's files and memory of the session agree."""
    data, dest = tmp_path / "a" / "data", tmp_path / "backup"
    agent = write_counter_agent(tmp_path / "agents", toml='scope = "session"\n')
    (agent / "agent.py").write_text(AGENT_PY.replace('remember(f"turn {n + 1}")',
                                                     'remember(f"turn {n + 1}", scope="session")'))
    host = LocalHost("box", data, ENV, start_timeout_s=300)
    errors: list[str] = []
    replies = {f"s{i}": 0 for i in range(8)}
    try:
        with Client(host.url, host.key) as sdk:
            sdk.deploy("counter", agent)
            stop = threading.Event()

            def turns(session: str) -> None:
                with Client(host.url, host.key) as c:
                    while not stop.is_set():
                        try:
                            replies[session] = int(c.invoke("counter", "go", user="ada", session=session)["reply"]
                                                   .split(":")[0])
                        except Exception as e:  # noqa: BLE001 - every failure is reported below
                            errors.append(f"{session}: {e}")

            threads = [threading.Thread(target=turns, args=(s,)) for s in replies]
            for t in threads:
                t.start()
            time.sleep(3)
            before = dict(replies)
            r = backup(data, dest)
            time.sleep(1)
            stop.set()
            for t in threads:
                t.join(timeout=120)
        assert r.returncode == 0 and "(online: 8 instance(s)" in r.stdout, r.stdout + r.stderr
        assert not errors, errors[:3]
        manifest = json.loads((dest / "moorage-backup.json").read_text())
        assert [i["point"] for i in manifest["instances"]] == ["held"] * 8
    finally:
        host.stop()
    restored = LocalHost("elsewhere", dest, ENV, start_timeout_s=300)
    try:
        with Client(restored.url, restored.key) as sdk:
            for s in replies:
                events = sdk.list_events("counter", "ada", session=s, limit=500)["data"]
                recorded = sorted(int(e["content"].split()[1]) for e in events
                                  if str(e.get("content", "")).startswith("turn "))
                n = len(recorded)
                assert recorded == list(range(1, n + 1)) and n >= before[s], (s, recorded, before)
                assert sdk.invoke("counter", "again", user="ada", session=s)["reply"] == f"{n + 1}: again", s
    finally:
        restored.stop()


def test_a_host_stopped_mid_backup_stops_it_cleanly_and_leaves_it_marked_incomplete(tmp_path: Path) -> None:
    data, dest = tmp_path / "a" / "data", tmp_path / "cut"
    host = LocalHost("box", data, ENV, start_timeout_s=300)
    try:
        with Client(host.url, host.key) as sdk:
            sdk.deploy("counter", agent_dir(tmp_path))
            assert sdk.invoke("counter", "hello", user="ada")["reply"] == "1: hello"
            assert sdk.invoke("counter", "hello", user="bob")["reply"] == "1: hello"

        def slow_turn() -> None:  # the backup waits for this turn of ada's while the host is asked to stop
            httpx.post(f"{host.url}/v1/agents/counter/invoke", json={"user": "ada", "message": "slow"},
                       headers={"Authorization": f"Bearer {host.key}"}, timeout=120)

        slow = threading.Thread(target=slow_turn)
        slow.start()
        # Until ada's turn runs (under load its wake can take longer than any fixed pause: the backup would then
        # copy ada before the turn and finish before the host is asked to stop).
        deadline = time.monotonic() + 60
        with Client(host.url, host.key) as sdk:
            while not [r for r in sdk.list_workflows(status="running", agent="counter")["data"]
                       if r["scope"].split("/")[1] == "ada"]:
                assert time.monotonic() < deadline, "ada's slow turn never began"
                time.sleep(0.1)
        time.sleep(0.5)
        cli = subprocess.Popen(backup_cmd(dest), env=backup_env(data), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd=ROOT)
        assert cli.stdout is not None
        assert "online backup of" in cli.stdout.readline()
        time.sleep(1)
    finally:
        host.stop()  # SIGTERM: the backup is stopped, the turn in flight finishes, instances sleep
    out, err = cli.communicate(timeout=60)
    slow.join(timeout=60)
    assert host.proc.returncode == 0, host.log.read_text()[-2000:]
    assert "the online backup in progress is stopped" in host.log.read_text()
    assert cli.returncode == 2 and "incomplete" in err, out + err
    assert (dest / "moorage-backup.incomplete").exists()
    # The original is whole: a restart serves both users where they were.
    again = LocalHost("box", data, ENV, start_timeout_s=300)
    try:
        with Client(again.url, again.key) as sdk:
            assert sdk.invoke("counter", "x", user="ada")["reply"] == "3: x"
            assert sdk.invoke("counter", "x", user="bob")["reply"] == "2: x"
    finally:
        again.stop()


def test_the_backup_lists_every_instance_of_a_tenant_past_a_thousand(tmp_path: Path) -> None:
    """The store answers a listing 1,000 instances at a time: the backup reads every page (an instance left out
    would be missing from the copy)."""
    import asyncio
    from types import SimpleNamespace

    from moorage.config import Config
    from moorage.runtime.backup import OnlineBackup
    from moorage.store import Scope, open_store

    store = open_store(Config(data_dir=tmp_path / "data"))
    try:
        tenant, _ = store.operator.create_tenant("many")
        ts = store.tenant(store.operator.principal(tenant.id))
        for i in range(1005):
            ts.sandboxes.create(Scope.for_user("a", f"u{i}"), state="sleeping")
        host = SimpleNamespace(manager=SimpleNamespace(system_tenant=lambda tid: ts))
        recs = asyncio.run(OnlineBackup(host, tmp_path / "b", None)._instances(tenant.id))  # type: ignore[arg-type]
        assert sorted(r.scope.user for r in recs) == sorted(f"u{i}" for i in range(1005))
    finally:
        store.close()


def test_a_tenant_created_as_the_backup_began_is_left_out_of_the_copy_whole(tmp_path: Path) -> None:
    """The backup lists the tenants, then copies the operator database: a tenant created in between was in the
    copy's operator database (with its keys) without its tenant database, and a restore served it empty."""
    from moorage.config import Config
    from moorage.errors import NotFound
    from moorage.runtime.backup import copy_control
    from moorage.store import open_store

    store = open_store(Config(data_dir=tmp_path / "data"))
    try:
        listed, _ = store.operator.create_tenant("listed")
        listed_keys = len(store.backend.list_api_keys(listed.id))
        store.operator.create_tenant("late")  # created after the backup listed the tenants
        (tmp_path / "copy" / "store").mkdir(parents=True)
        copy_control(tmp_path / "data" / "store" / "control.db", tmp_path / "copy" / "store" / "control.db",
                     [listed.id])
    finally:
        store.close()
    copy = open_store(Config(data_dir=tmp_path / "copy"))
    try:
        assert [t.name for t in copy.operator.list_tenants()] == ["listed"]
        assert len(copy.backend.list_api_keys(listed.id)) == listed_keys
        with pytest.raises(NotFound):
            copy.operator.get_tenant("late")
    finally:
        copy.close()

