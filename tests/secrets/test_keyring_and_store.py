"""Secrets at rest: the operator's key file (0600, made once, rotated), AES-GCM bound to the owner, and the
tenant store's rows (both backends) holding ciphertext only, listed without values, forgotten with the user."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from moorage.config import Config
from moorage.errors import ConfigError, InvalidInput, NotFound
from moorage.secrets import Keyring, SecretStore, SecretUnreadable, rotate_key_file
from moorage.store import Store, TenantStore

VALUE = "ghp_canary_0123456789abcdef"


def test_the_key_file_is_made_once_with_mode_0600_even_by_racing_starts(tmp_path: Path) -> None:
    cfg = Config(data_dir=tmp_path / "data")
    rings: list[Keyring] = []
    threads = [threading.Thread(target=lambda: rings.append(Keyring.from_config(cfg))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    path = cfg.data_dir / "secrets.key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len({r.primary for r in rings}) == 1 and len(path.read_text().splitlines()) == 1
    assert [p.name for p in path.parent.iterdir()] == ["secrets.key"]  # no temporary file left behind


def test_a_key_file_others_can_read_is_refused(tmp_path: Path) -> None:
    cfg = Config(data_dir=tmp_path)
    Keyring.from_config(cfg)
    os.chmod(tmp_path / "secrets.key", 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        Keyring.from_config(cfg)


def test_ciphertext_is_bound_to_its_owner_and_checked(tmp_path: Path) -> None:
    ring = Keyring.from_config(Config(data_dir=tmp_path))
    blob, kid = ring.encrypt(VALUE.encode(), b"tenant-a/agent/name")
    assert VALUE.encode() not in blob and kid == ring.primary
    assert ring.decrypt(blob, b"tenant-a/agent/name") == VALUE.encode()
    with pytest.raises(SecretUnreadable):
        ring.decrypt(blob, b"tenant-b/agent/name")  # moved to another owner
    tampered = blob[:-1] + bytes([blob[-1] ^ 1])
    with pytest.raises(SecretUnreadable):
        ring.decrypt(tampered, b"tenant-a/agent/name")


def test_keys_from_config_and_bad_keys(tmp_path: Path) -> None:
    ring = Keyring.from_config(Config(data_dir=tmp_path))
    text = (tmp_path / "secrets.key").read_text().strip()
    from_cfg = Keyring.from_config(Config(data_dir=tmp_path / "elsewhere", secrets_keys=text))
    blob, _ = ring.encrypt(b"x", b"c")
    assert from_cfg.decrypt(blob, b"c") == b"x"
    assert not (tmp_path / "elsewhere" / "secrets.key").exists()
    with pytest.raises(ConfigError):
        Keyring.from_config(Config(data_dir=tmp_path, secrets_keys="short:abc"))


def test_store_rows_hold_ciphertext_and_listings_hold_no_values(store: Store, tenant: TenantStore, tmp_path: Path) -> None:
    secrets = SecretStore.from_config(Config(data_dir=tmp_path))
    tenant.agents.create("gh")
    info = secrets.set(tenant, "gh", "GITHUB_TOKEN", VALUE)
    assert info.version == 1 and VALUE not in repr(info)
    assert secrets.set(tenant, "gh", "GITHUB_TOKEN", VALUE + "2").version == 2
    secrets.set(tenant, "gh", "GITHUB_TOKEN", "user-own", user="ada")
    assert [i.name for i in secrets.list(tenant, "gh")] == ["GITHUB_TOKEN"]
    assert VALUE not in repr(secrets.list(tenant, "gh")) and VALUE not in repr(secrets.list(tenant, "gh", "ada"))
    blob, _ = tenant.secrets.ciphertext("gh", None, "GITHUB_TOKEN")  # type: ignore[misc]
    assert VALUE.encode() not in blob
    # The user's own secret wins for that user; everyone else gets the agent's.
    assert secrets.reveal(tenant, "gh", "GITHUB_TOKEN", "ada") == "user-own"
    assert secrets.reveal(tenant, "gh", "GITHUB_TOKEN", "bob") == VALUE + "2"
    tenant.forget_user("ada", "gh")
    assert secrets.list(tenant, "gh", "ada") == [] and secrets.reveal(tenant, "gh", "GITHUB_TOKEN", "ada") == VALUE + "2"
    secrets.remove(tenant, "gh", "GITHUB_TOKEN")
    assert secrets.reveal(tenant, "gh", "GITHUB_TOKEN") is None
    with pytest.raises(NotFound):
        secrets.remove(tenant, "gh", "GITHUB_TOKEN")


def test_secrets_are_per_tenant(store: Store, tenant: TenantStore, other_tenant: TenantStore, tmp_path: Path) -> None:
    secrets = SecretStore.from_config(Config(data_dir=tmp_path))
    secrets.set(tenant, "gh", "TOKEN", VALUE)
    assert other_tenant.secrets.list("gh") == [] and secrets.reveal(other_tenant, "gh", "TOKEN") is None


@pytest.mark.parametrize("name,value", [("lower", "v"), ("TOKEN", ""), ("TOKEN", "a\nb"), ("TOKEN", "a\r"),
                                        ("TOKEN", "x" * 20000)])
def test_malformed_names_and_values_are_refused(tenant: TenantStore, tmp_path: Path, name: str, value: str) -> None:
    with pytest.raises(InvalidInput):
        SecretStore.from_config(Config(data_dir=tmp_path)).set(tenant, "gh", name, value)


def test_key_rotation_reencrypts_and_running_readers_follow(store: Store, tenant: TenantStore, tmp_path: Path) -> None:
    cfg = Config(data_dir=tmp_path)
    running = SecretStore.from_config(cfg)  # a server that started before the rotation
    running.set(tenant, "gh", "TOKEN", VALUE)
    old = running.keyring.primary
    new = rotate_key_file(cfg.data_dir / "secrets.key")
    assert stat.S_IMODE((cfg.data_dir / "secrets.key").stat().st_mode) == 0o600
    rotated = SecretStore.from_config(cfg)
    assert rotated.keyring.primary == new and {k for k, _ in rotated.keyring.keys} == {old, new}
    assert rotated.reencrypt(tenant) == 1 and rotated.reencrypt(tenant) == 0
    assert [i.key_id for i in tenant.secrets.list("gh")] == [new]
    # The running reader has never seen the new key: it loads it when it first meets it.
    assert running.reveal(tenant, "gh", "TOKEN") == VALUE
