"""Secrets: encrypted at rest under the operator's key, bound to hosts and headers, never returned or traced.

The gateway and ``ctx.fetch`` add them upstream; the guest sees one only if its agent opts into ``env``.
See docs/egress.md.
"""

from moorage.secrets.bindings import Binding, Bindings
from moorage.secrets.keyring import KEY_FILE as KEY_FILE_NAME, Keyring, SecretUnreadable, rotate_key_file
from moorage.secrets.service import SecretStore
from moorage.store.repos.secrets import SecretInfo

__all__ = ["KEY_FILE_NAME", "Binding", "Bindings", "Keyring", "SecretInfo", "SecretStore", "SecretUnreadable", "rotate_key_file"]
