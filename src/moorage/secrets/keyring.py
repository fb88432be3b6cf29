"""The operator's secret-encryption keys: AES-256-GCM, the first key encrypts, every key decrypts.

Keys come from ``secrets_keys`` in config or from the 0600 file ``secrets.key`` in the data directory,
created atomically on first use; ``rotate_key_file`` puts a new key first (old ones stay to decrypt).
"""

from __future__ import annotations

import base64
import os
import secrets as pysecrets
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from moorage.errors import ConfigError, MoorageError

KEY_FILE = "secrets.key"
_MAGIC = b"ms1"
_KID_LEN = 8


class SecretUnreadable(MoorageError):
    """A stored secret cannot be decrypted with any of the operator's keys (a key was removed, or the row
    was tampered with)."""

    code = "secret-unreadable"
    http_status = 500


def new_key() -> tuple[str, bytes]:
    return pysecrets.token_hex(_KID_LEN // 2), AESGCM.generate_key(bit_length=256)


def _encode(kid: str, key: bytes) -> str:
    return f"{kid}:{base64.urlsafe_b64encode(key).decode()}"


def parse_keys(text: str, where: str) -> list[tuple[str, bytes]]:
    keys = []
    for item in text.replace("\n", ",").split(","):
        item = item.strip()
        if not item or item.startswith("#"):
            continue
        kid, sep, b64 = item.partition(":")
        try:
            key = base64.urlsafe_b64decode(b64)
        except ValueError:
            key = b""
        if not sep or len(kid) != _KID_LEN or not kid.isalnum() or len(key) != 32:
            raise ConfigError(f"{where}: a key must be 'id:base64' with an 8-character id and 32 key bytes",
                              hint="make one with `moorage secrets rotate-key`, or remove the entry")
        keys.append((kid, key))
    if not keys:
        raise ConfigError(f"{where} holds no key")
    return keys


def _write_new(path: Path, text: str) -> None:
    """Write ``text`` as a new 0600 file at ``path``, atomically; FileExistsError if someone was first."""
    tmp = path.with_name(f".{path.name}.{pysecrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, path)  # fails if the file exists: two first starts agree on one key
    finally:
        tmp.unlink(missing_ok=True)


@dataclass(frozen=True)
class Keyring:
    keys: tuple[tuple[str, bytes], ...] = field(repr=False)
    source: str = ""

    @property
    def primary(self) -> str:
        return self.keys[0][0]

    @classmethod
    def from_config(cls, cfg: Any) -> "Keyring":
        if cfg.secrets_keys:
            return cls(tuple(parse_keys(cfg.secrets_keys, "secrets_keys")), "config")
        return cls.from_file(Path(cfg.data_dir) / KEY_FILE)

    @classmethod
    def from_file(cls, path: Path) -> "Keyring":
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            try:
                _write_new(path, _encode(*new_key()) + "\n")
            except FileExistsError:
                pass
        mode = path.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(f"{path} is readable by other users", hint=f"chmod 600 {path}")
        return cls(tuple(parse_keys(path.read_text(), str(path))), str(path))

    def knows(self, blob: bytes) -> bool:
        """Whether the key that encrypted ``blob`` is in this keyring."""
        kid = blob[len(_MAGIC):len(_MAGIC) + _KID_LEN].decode("ascii", "replace")
        return any(k == kid for k, _ in self.keys)

    def _aead(self, kid: str) -> AESGCM:
        for k, key in self.keys:
            if k == kid:
                return AESGCM(key)
        raise SecretUnreadable(f"secret encrypted with key {kid!r}, which the operator no longer has",
                               hint="restore that key in secrets_keys or the key file, or set the secret again")

    def encrypt(self, plaintext: bytes, context: bytes) -> tuple[bytes, str]:
        """Ciphertext of ``plaintext`` bound to ``context`` (who owns it), and the id of the key used."""
        kid = self.primary
        nonce = os.urandom(12)
        return _MAGIC + kid.encode() + nonce + self._aead(kid).encrypt(nonce, plaintext, context), kid

    def decrypt(self, blob: bytes, context: bytes) -> bytes:
        if not blob.startswith(_MAGIC) or len(blob) < len(_MAGIC) + _KID_LEN + 12 + 16:
            raise SecretUnreadable("a stored secret is not in a known format")
        kid = blob[len(_MAGIC):len(_MAGIC) + _KID_LEN].decode("ascii", "replace")
        nonce = blob[len(_MAGIC) + _KID_LEN:len(_MAGIC) + _KID_LEN + 12]
        try:
            return self._aead(kid).decrypt(nonce, blob[len(_MAGIC) + _KID_LEN + 12:], context)
        except InvalidTag:
            raise SecretUnreadable("a stored secret failed its integrity check",
                                   hint="it was changed outside moorage, or moved to another owner; set it again") from None


def rotate_key_file(path: Path) -> str:
    """Put a new key first in the key file (atomic replace, 0600); returns its id. Old keys stay for decrypting
    until ``reencrypt`` has moved every secret to the new one."""
    old = path.read_text() if path.exists() else ""
    kid, key = new_key()
    tmp = path.with_name(f".{path.name}.{pysecrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(_encode(kid, key) + "\n" + old)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return kid
