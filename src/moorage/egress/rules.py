"""An agent's egress rules and the requests they are matched against: scheme, host, port and path.

A rule is written ``scheme://host[:port][/path]``; host is exact or ``*.example.com``; URLs are parsed
strictly (no userinfo, no dot-segments, no backslashes) so that what is checked is what is fetched.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable
from urllib.parse import unquote, urlsplit

from moorage.egress.addresses import parse_ip
from moorage.errors import InvalidInput, TenantScopeError

SCHEMES = {"http": 80, "https": 443}
MAX_URL = 8192
# Matched with ``fullmatch``: a ``$`` anchor would let a label end in a newline.
_LABEL = re.compile(r"(?!-)[a-z0-9_-]{1,63}(?<!-)")
_BAD_CHARS = re.compile(r"[\x00-\x20\x7f\\]")


class EgressPolicyError(InvalidInput):
    """An ``[agent.egress]``/``[agent.network]`` rule or an operator rule cannot be read; nothing was allowed."""

    code = "egress-policy"


class EgressDenied(TenantScopeError):
    """The policy refuses this request (scheme, host, port, path or the address the host resolves to)."""

    code = "egress-denied"


def normalize_host(raw: str) -> str:
    """Lower-case ASCII form of a host name (IDNA for non-ASCII, no trailing dot), or an IP literal as written."""
    host = raw.strip()
    ip = parse_ip(host)
    if ip is not None:
        if "%" in str(ip):
            raise ValueError("IPv6 zone identifiers are not allowed")
        return str(ip)
    host = host.rstrip(".").lower()
    if not host:
        raise ValueError("empty host")
    if not host.isascii():
        host = host.encode("idna").decode("ascii")
    labels = host.split(".")
    if not all(_LABEL.fullmatch(label) for label in labels):
        raise ValueError(f"{raw!r} is not a host name")
    if len(host) > 253:
        raise ValueError("host name too long")
    return host


def _dot_segment(segment: str) -> bool:
    return unquote(segment) in (".", "..")


@dataclass(frozen=True)
class Target:
    """One request's destination, parsed strictly; ``path`` includes the query."""

    scheme: str
    host: str
    port: int
    path: str = "/"
    #: Some path segment carries an encoded ``/`` or ``\\`` (matters only under a path-restricted rule).
    encoded_separator: bool = False

    @property
    def is_ip(self) -> bool:
        return parse_ip(self.host) is not None

    @property
    def authority(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == SCHEMES.get(self.scheme) else f"{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.authority}{self.path}"

    @property
    def origin(self) -> str:
        return f"{self.scheme}://{self.authority}"

    @classmethod
    def parse(cls, url: Any) -> "Target":
        """Parse an absolute http(s) URL; anything ambiguous is refused rather than guessed."""
        if not isinstance(url, str) or not url:
            raise EgressDenied("the URL must be a non-empty string")
        if len(url) > MAX_URL:
            raise EgressDenied(f"the URL is over {MAX_URL} characters")
        if _BAD_CHARS.search(url):
            raise EgressDenied("the URL holds whitespace, control characters or a backslash",
                               hint="percent-encode them")
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as e:
            raise EgressDenied(f"malformed URL: {e}") from None
        scheme = parts.scheme.lower()
        if scheme not in SCHEMES:
            raise EgressDenied(f"only http and https URLs can be fetched, not {parts.scheme or 'a relative URL'!r}")
        if "@" in parts.netloc:
            # https://api.github.com@evil.example/ goes to evil.example: userinfo is refused, never stripped.
            raise EgressDenied("URLs with a user name or password (user@host) are not allowed",
                               hint="bind credentials as secrets in [agent.secrets]; the host adds them")
        if not parts.hostname:
            raise EgressDenied("the URL names no host")
        try:
            host = normalize_host(parts.hostname)
        except (ValueError, UnicodeError) as e:
            raise EgressDenied(f"the URL's host is not valid: {e}") from None
        path = parts.path or "/"
        if not path.startswith("/"):
            raise EgressDenied("the URL's path must start with '/'")
        segments = path.split("/")
        if any(_dot_segment(s) for s in segments):
            # /allowed/../secret would be normalized by some servers into a path the rule never admitted.
            raise EgressDenied("the URL's path has '.' or '..' segments", hint="send the normalized path")
        encoded_sep = any(("/" in unquote(s) or "\\" in unquote(s)) for s in segments)
        if parts.query:
            path += "?" + parts.query
        return cls(scheme, host, port if port is not None else SCHEMES[scheme], path, encoded_sep)


@dataclass(frozen=True)
class Rule:
    """One allowed destination: scheme, host (exact, ``*.suffix`` or ``*``), port (None: any) and path prefix."""

    scheme: str
    host: str
    port: int | None
    path: str = ""  # "" : any path
    source: str = ""

    @classmethod
    def parse(cls, text: Any, where: str = "[agent.egress] allow") -> "Rule":
        if not isinstance(text, str) or not text.strip():
            raise EgressPolicyError(f"{where}: each entry must be a non-empty string, not {text!r}",
                                    hint='write entries like "https://api.github.com" or "https://*.example.com:8443/v1/"')
        raw = text.strip()
        body = raw if "://" in raw else "https://" + raw  # a bare host means HTTPS on 443
        scheme, _, rest = body.partition("://")
        scheme = scheme.lower()
        if scheme not in SCHEMES:
            raise EgressPolicyError(f"{where}: {raw!r} has scheme {scheme!r}", hint="use http:// or https://")
        authority, slash, path = rest.partition("/")
        if _BAD_CHARS.search(raw) or "@" in authority or "?" in rest or "#" in rest:
            raise EgressPolicyError(f"{where}: {raw!r} may not hold a user name, query, fragment or spaces")
        if not authority:
            raise EgressPolicyError(
                f"{where}: {raw!r} names no host",
                hint=f'name the host ("{scheme}://api.example.com"), or "{scheme}://*" for any public host',
            )
        port: int | None = SCHEMES[scheme]
        host = authority
        if authority.startswith("["):
            end = authority.find("]")
            host, tail = authority[: end + 1], authority[end + 1:]
            if tail:
                port = cls._port(tail.lstrip(":"), raw, where) if tail.startswith(":") else cls._bad(raw, where)
        elif ":" in authority:
            host, _, p = authority.rpartition(":")
            port = cls._port(p, raw, where)
        if host != "*":
            wildcard = host.startswith("*.")
            try:
                name = normalize_host(host[2:] if wildcard else host)
            except (ValueError, UnicodeError) as e:
                raise EgressPolicyError(f"{where}: {raw!r}: {e}") from None
            if wildcard and parse_ip(name) is not None:
                raise EgressPolicyError(f"{where}: {raw!r}: a wildcard needs a domain, not an address")
            host = ("*." + name) if wildcard else name
        path = "/" + path if slash else ""
        if path and any(_dot_segment(s) for s in path.split("/")):
            raise EgressPolicyError(f"{where}: {raw!r}: a path may not hold '.' or '..' segments")
        if path in ("/",):
            path = ""
        return cls(scheme, host, port, path, raw)

    @staticmethod
    def _port(p: str, raw: str, where: str) -> int | None:
        if p in ("", "*"):  # "http://127.0.0.1:" (the old prefix form) and ":*" mean any port
            return None
        if not p.isdigit() or not 0 < int(p) < 65536:
            raise EgressPolicyError(f"{where}: {raw!r} has a bad port {p!r}", hint="a port is 1-65535, or * for any")
        return int(p)

    @staticmethod
    def _bad(raw: str, where: str) -> int:
        raise EgressPolicyError(f"{where}: {raw!r} is not scheme://host[:port][/path]")

    def host_matches(self, host: str) -> bool:
        if self.host == "*":
            return True
        if self.host.startswith("*."):
            # *.example.com: any name under example.com (not example.com itself, not evil-example.com).
            return host.endswith(self.host[1:]) and len(host) > len(self.host) - 1 and parse_ip(host) is None
        return host == self.host

    def path_matches(self, path: str) -> bool:
        if not self.path:
            return True
        bare = path.split("?", 1)[0]
        prefix = self.path.rstrip("/")
        # Segment-wise: /repos admits /repos and /repos/x, not /repos-evil.
        return bare == prefix or bare.startswith(prefix + "/")

    def admits(self, t: Target) -> bool:
        if t.scheme != self.scheme or not self.host_matches(t.host):
            return False
        if self.port is not None and t.port != self.port:
            return False
        if self.path and t.encoded_separator:
            return False  # an encoded '/' could step outside the prefix on the server's side
        return self.path_matches(t.path)

    def admits_tunnel(self, host: str, port: int) -> bool:
        """A CONNECT tunnel (TLS the host cannot see into): an https rule with no path restriction."""
        return (self.scheme == "https" and not self.path and self.host_matches(host)
                and (self.port is None or self.port == port))


def parse_rules(entries: Any, where: str) -> tuple[Rule, ...]:
    if entries is None:
        return ()
    if isinstance(entries, str):
        entries = [e for e in entries.split(",") if e.strip()]
    if not isinstance(entries, (list, tuple)):
        raise EgressPolicyError(f"{where} must be a list of strings", hint='e.g. allow = ["https://api.github.com"]')
    return tuple(Rule.parse(e, where) for e in entries)


def first_match(rules: Iterable[Rule], t: Target) -> Rule | None:
    return next((r for r in rules if r.admits(t)), None)
