"""Hosts joining a fleet must share the installation's secrets: compared by fingerprint when a host registers."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from moorage.errors import ConfigError
from moorage.fleet.hosts import HostRegistry, fingerprints
from moorage.store.sqlite import SQLiteBackend

OLD, NEW = ("aaaa1111", b"o" * 32), ("bbbb2222", b"n" * 32)


def test_a_host_whose_secrets_differ_from_a_live_hosts_is_refused(tmp_path: Path) -> None:
    reg = HostRegistry(SQLiteBackend(tmp_path / "store"))
    mine = fingerprints("tok", "op", [OLD])
    reg.register("h1", "http://10.0.0.1:7700", "i1", mine, ttl_s=15)
    assert reg.get("h1").secrets == mine and "sekrit" not in str(fingerprints("sekrit", "op", [OLD]))
    reg.register("h2", "http://10.0.0.2:7700", "i2", fingerprints("tok", "op", [OLD]), ttl_s=15)  # same: joins
    with pytest.raises(ConfigError, match="api/token-secret differs from host h1's"):
        reg.register("h3", "http://10.0.0.3:7700", "i3", fingerprints("other", "op", [OLD]), ttl_s=15)
    with pytest.raises(ConfigError, match="api/operator-token differs"):
        reg.register("h3", "http://10.0.0.3:7700", "i3", fingerprints("tok", "other", [OLD]), ttl_s=15)
    with pytest.raises(ConfigError, match="lacks the secrets key 'aaaa1111' that host h1 encrypts"):
        reg.register("h3", "http://10.0.0.3:7700", "i3", fingerprints("tok", "op", [NEW]), ttl_s=15)
    assert {h.id for h in reg.list()} == {"h1", "h2"}  # a refused host wrote nothing
    # A key rotation: the new key added everywhere first (second), then made first host by host.
    reg.register("h3", "http://10.0.0.3:7700", "i3", fingerprints("tok", "op", [NEW, OLD]), ttl_s=15)
    # A host that is not alive does not hold the others back (nor does one from before the fingerprints).
    reg.set_state("h1", "gone")
    reg.set_state("h2", "gone")
    reg.register("h4", "http://10.0.0.4:7700", "i4", fingerprints("tok", "op", [NEW]), ttl_s=15)
    reg.register("h5", "http://10.0.0.5:7700", "i5", None, ttl_s=15)


def test_a_lapsed_hosts_secrets_are_not_compared(tmp_path: Path) -> None:
    reg = HostRegistry(SQLiteBackend(tmp_path / "store"))
    reg.register("h1", "http://10.0.0.1:7700", "i1", fingerprints("tok", "op", [OLD]), ttl_s=15)
    with reg.backend.control_tx() as c:
        c.x("UPDATE hosts SET heartbeat_at = ? WHERE id = 'h1'", (time.time() - 60,))
    reg.register("h2", "http://10.0.0.2:7700", "i2", fingerprints("new", "op", [OLD]), ttl_s=15)


def test_hosts_commands_say_what_store_they_lack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from moorage.cli.main import app

    monkeypatch.delenv("MOORAGE_STORE_URL", raising=False)
    monkeypatch.setenv("MOORAGE_DATA_DIR", str(tmp_path / "data"))
    for args, says in ((["hosts", "drain", "h1"], "none is configured"),
                       (["hosts", "drain", "h1", "--store-url", "sqlite"], "none is configured"),
                       (["hosts", "--store-url", "mysql://db/x"], "the store is 'mysql://db/x', not one")):
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 2 and says in " ".join(r.output.split()), (args, r.output)
    assert not (tmp_path / "data").exists()  # no local store was made
