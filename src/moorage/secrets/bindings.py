"""How an agent uses its secrets, from ``[agent.secrets]`` in moorage.toml: which header, in what format,
for which hosts; and the opt-in ``env = ["NAME"]`` list of secrets put into the guest's environment.

``GITHUB_TOKEN = { header = "Authorization", format = "Bearer {}", hosts = ["api.github.com"] }``
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from moorage.egress.rules import EgressPolicyError, normalize_host
from moorage.store.repos.secrets import check_secret_name

_HEADER = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}$")
# Headers a secret may not be put in: they would change framing or routing, not authenticate.
_FORBIDDEN = {"host", "content-length", "transfer-encoding", "connection", "upgrade", "te", "trailer",
              "proxy-connection", "keep-alive"}


@dataclass(frozen=True)
class Binding:
    name: str
    header: str
    format: str
    #: Host names (exact or ``*.example.com``), optionally with ``:port``.
    hosts: tuple[str, ...]

    def applies_to(self, host: str, port: int) -> bool:
        for pattern in self.hosts:
            name, _, p = pattern.rpartition(":") if pattern.count(":") == 1 else (pattern, "", "")
            if p and int(p) != port:
                continue
            if name.startswith("*.") and host.endswith(name[1:]) and len(host) > len(name) - 1:
                return True
            if host == name:
                return True
        return False

    def render(self, value: str) -> str:
        return self.format.replace("{}", value, 1)


@dataclass(frozen=True)
class Bindings:
    headers: tuple[Binding, ...] = ()
    env: tuple[str, ...] = ()

    def for_host(self, host: str, port: int) -> tuple[Binding, ...]:
        return tuple(b for b in self.headers if b.applies_to(host, port))

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any] | None) -> "Bindings":
        table = (manifest or {}).get("secrets") or {}
        where = "[agent.secrets]"
        if not isinstance(table, dict):
            raise EgressPolicyError(f"{where} must be a table",
                                    hint='e.g. GITHUB_TOKEN = { header = "Authorization", format = "Bearer {}", hosts = ["api.github.com"] }')
        env = table.get("env") or []
        if not isinstance(env, list):
            raise EgressPolicyError(f"{where} env must be a list of secret names", hint='e.g. env = ["OPENAI_API_KEY"]')
        env_names = tuple(_name(n, f"{where} env") for n in env)
        out = []
        for name, spec in table.items():
            if name == "env":
                continue
            _name(name, where)
            if not isinstance(spec, dict):
                raise EgressPolicyError(f"{where} {name} must be a table with header, format and hosts")
            unknown = set(spec) - {"header", "format", "hosts"}
            if unknown:
                raise EgressPolicyError(f"{where} {name}: unknown keys {sorted(unknown)}", hint="use header, format, hosts")
            header = spec.get("header", "Authorization")
            if not isinstance(header, str) or not _HEADER.match(header) or header.lower() in _FORBIDDEN:
                raise EgressPolicyError(f"{where} {name}: {header!r} is not a header a secret can go in")
            fmt = spec.get("format", "{}")
            if not isinstance(fmt, str) or fmt.count("{}") != 1 or "\r" in fmt or "\n" in fmt:
                raise EgressPolicyError(f"{where} {name}: format must contain {{}} exactly once", hint='e.g. "Bearer {}"')
            hosts = spec.get("hosts")
            if not isinstance(hosts, list) or not hosts:
                raise EgressPolicyError(f"{where} {name}: hosts must list where the secret may be sent",
                                        hint='e.g. hosts = ["api.github.com"]; a secret is never sent to every host')
            out.append(Binding(name, header, fmt, tuple(_host(h, f"{where} {name}") for h in hosts)))
        return cls(tuple(out), env_names)


def _name(n: Any, where: str) -> str:
    try:
        return check_secret_name(n)
    except Exception:
        raise EgressPolicyError(f"{where}: {n!r} is not a secret name", hint="use names like GITHUB_TOKEN") from None


def _host(h: Any, where: str) -> str:
    if not isinstance(h, str) or not h or "/" in h or "@" in h:
        raise EgressPolicyError(f"{where}: hosts entries are host names like api.github.com, not {h!r}")
    name, port = h, ""
    if h.count(":") == 1:
        name, _, port = h.partition(":")
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise EgressPolicyError(f"{where}: {h!r} has a bad port")
    wildcard = name.startswith("*.")
    try:
        norm = normalize_host(name[2:] if wildcard else name)
    except (ValueError, UnicodeError) as e:
        raise EgressPolicyError(f"{where}: {h!r}: {e}") from None
    return ("*." if wildcard else "") + norm + (f":{port}" if port else "")
