"""The one place moorage reads its configuration: defaults < ``moorage.toml`` < ``MOORAGE_*`` env.

``load()`` is called once at process start and the resulting ``Config`` is passed down.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from moorage.errors import ConfigError


def _default_data_dir(env: Mapping[str, str] | None = None) -> Path:
    """``$XDG_DATA_HOME/moorage``, or ``~/.local/share/moorage`` where XDG_DATA_HOME is unset or empty."""
    base = (os.environ if env is None else env).get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "moorage"


@dataclass(frozen=True)
class Config:
    #: Where the embedded store, images, disks and snapshots live.
    data_dir: Path = field(default_factory=_default_data_dir)
    #: ``sqlite`` (embedded, files under data_dir) or a ``postgresql://`` URL.
    store_url: str = "sqlite"
    #: Role the application connects as on PostgreSQL (must not own the tables).
    store_app_role: str = "moorage_app"
    #: Full URL the application connects with on PostgreSQL; derived from store_url and the role if empty.
    store_app_url: str = dataclasses.field(default="", repr=False)
    #: Sandbox driver: ``auto`` (microvm; an error when QEMU is missing), ``microvm`` or ``process``. The process
    #: driver shares the host kernel, so it is never picked silently: naming it is the operator's opt-in.
    sandbox_driver: str = "auto"
    #: Accelerator for the microvm driver: ``auto`` (probe KVM by booting), ``kvm`` or ``tcg``.
    accel: str = "auto"
    guest_memory_mib: int = 256
    #: Largest ``memory_mib`` / ``vcpus`` / ``disk_mib`` one agent may ask for in its moorage.toml (0: what the
    #: host has: its memory less a reserve, its CPUs, the free disk under the sandboxes directory).
    agent_max_memory_mib: int = 0
    agent_max_vcpus: int = 0
    agent_max_disk_mib: int = 0
    #: S3-compatible object store for snapshots and disks at fleet scale (empty: local disk only).
    object_store_url: str = ""
    #: S3 endpoint for an ``s3://`` object store (e.g. ``http://127.0.0.1:8333``); empty: AWS's own.
    object_store_endpoint: str = ""
    object_store_region: str = "us-east-1"
    #: Credentials for an ``s3://`` object store (both required: moorage never falls back to instance metadata).
    object_store_access_key: str = dataclasses.field(default="", repr=False)
    object_store_secret_key: str = dataclasses.field(default="", repr=False)
    host: str = "127.0.0.1"
    #: 0: a free port the kernel picks, said as the host starts and recorded in ``moorage-up.json``, where the CLI
    #: and ``Client()`` on this machine find it (a fleet host so started needs ``host_url``).
    port: int = 7700
    #: A fleet (docs/fleet.md) forms when the store is PostgreSQL and ``object_store_url`` is set: this host's
    #: unique id (default: the machine's hostname), the URL other hosts reach it at (default http://host:port),
    #: how long its leases on awake instances outlive its last heartbeat, and how often it heartbeats.
    host_id: str = ""
    host_url: str = ""
    lease_ttl_s: float = 15.0
    heartbeat_s: float = 3.0
    #: Fleet: an awake instance's state is shipped after turns (at most every 2 s) and at least this often, so a
    #: host crash loses at most what came after (drivers that can freeze a running sandbox: process).
    checkpoint_interval_s: float = 60.0
    #: Fleet: MiB of sleeping instances' copies a host keeps on its disk (a cache of the object store; least
    #: recently used evicted first, checked every checkpoint_interval_s); 0: no bound.
    fleet_cache_mib: float = 20480.0
    #: Templates nobody needs any more (a redeploy replaced them, their user was forgotten) are deleted from this
    #: host and from the object store every ``template_gc_interval_s`` and after each deploy; one younger than
    #: ``template_gc_grace_s`` always stays, and one retired in the object store is deleted no sooner than
    #: ``template_gc_settle_s`` later (docs/fleet.md, "Retention").
    template_gc_interval_s: float = 300.0
    template_gc_grace_s: float = 600.0
    template_gc_settle_s: float = 60.0
    #: Fleet: the templates of up to ``template_prefetch`` live deployments (those with most instances first) are
    #: fetched to this host ahead of their first wake here, at start and every ``template_prefetch_interval_s``;
    #: 0: each is fetched by the first wake that needs it (docs/fleet.md, "Templates fetched ahead").
    template_prefetch: int = 8
    template_prefetch_interval_s: float = 60.0
    #: What a clean stop of ``moorage up`` (SIGTERM, Ctrl-C) does with awake instances: ``sleep`` them (a durable
    #: snapshot each) or ``detach`` (micro-VMs keep running for a live upgrade; the next start re-adopts them).
    shutdown: str = "sleep"
    #: Where the CLI's client commands reach a moorage server (default: http://host:port).
    api_url: str = ""
    #: API key the CLI uses (default: the local tenant's admin key that `moorage up` wrote in data_dir).
    api_key: str = dataclasses.field(default="", repr=False)
    #: LLM provider: ``embedded`` (llama.cpp, offline), ``openai`` (any compatible base URL) or ``anthropic``.
    llm_provider: str = "embedded"
    llm_base_url: str = ""
    llm_api_key: str = dataclasses.field(default="", repr=False)
    llm_model: str = ""
    #: Threads the embedded model computes with; 0: half the CPUs this process may use, at least 1, at most 4
    #: (its threads wait for each other spinning: with one for every CPU, anything else busy on the host stalls it).
    llm_threads: int = 0
    #: The operator's per-tenant LLM policy (TOML: allowed models, rate limits, monthly tokens, unpriced models;
    #: docs/llm.md); empty: every tenant may call any model, unlimited.
    llm_policy: str = ""
    #: Awake instances (and their guest RAM, MiB) one host keeps at most; past it the least recently active
    #: idle instance is put to sleep first. Awake instances one tenant may have on one host. 0: no limit.
    max_awake_instances: int = 0
    max_awake_ram_mib: int = 0
    max_awake_per_tenant: int = 0
    #: Working-memory compaction summaries: ``extractive`` (offline, deterministic) or ``model`` (through the gateway).
    memory_summarizer: str = "extractive"
    #: Semantic-memory fact extraction: ``patterns`` (offline) or ``model`` (through the gateway, tenant's budget).
    memory_extractor: str = "patterns"
    #: OTLP/HTTP traces endpoint ``moorage up`` sends a copy of every span to (e.g.
    #: ``http://127.0.0.1:4318/v1/traces``); empty: spans are kept in the store only.
    otlp_endpoint: str = ""
    log_level: str = "info"
    log_format: str = "text"
    #: Maximum size of one stored value (state value, event content, step result), bytes.
    max_value_bytes: int = 1 << 20
    #: Egress (docs/egress.md): admit private ranges (RFC 1918, unique-local, 100.64/10) after resolving;
    #: loopback, link-local and metadata addresses stay refused unless a range below names them.
    egress_allow_private: bool = False
    #: Address ranges egress may reach whatever their kind, comma-separated (tests: 127.0.0.0/8,::1/128).
    egress_allow_cidrs: str = ""
    #: Package indexes an agent reaches with ``[agent.network] packages = true`` (and deploy-time installs),
    #: as egress rules, comma-separated.
    egress_package_index: str = "https://pypi.org,https://files.pythonhosted.org,http://deb.debian.org/debian/"
    #: The package index pip uses for an agent's requirements.txt at deploy time (empty: PyPI's); it must be
    #: admitted by egress_package_index.
    package_index_url: str = ""
    #: The Debian mirror apt uses for an agent's ``[agent] apt`` packages at deploy time (empty: Debian's own,
    #: http://deb.debian.org/debian); it must be admitted by egress_package_index. ``package_apt_trusted`` skips
    #: apt's signature check, for a local mirror the operator built without a key (never for a public one).
    package_apt_url: str = ""
    package_apt_trusted: bool = False
    #: Per-instance egress limits: open connections, new connections per second, bytes per second (0: no
    #: limit) and bytes per wake (0: no limit).
    egress_max_connections: int = 32
    egress_connects_per_s: int = 20
    egress_bytes_per_s: int = 0
    egress_max_bytes: int = 1 << 30
    #: An agent's own web app (docs/app.md): request and response body caps, seconds until the app's answer
    #: starts, and the longest one exchange may last (a streamed answer included).
    app_max_request_bytes: int = 16 << 20
    app_max_response_bytes: int = 256 << 20
    app_timeout_s: int = 60
    app_max_duration_s: int = 600
    #: WebSockets to an agent's app: the largest message relayed either way (a larger one closes the socket with
    #: 1009), and how many sockets one instance may have open at once.
    app_ws_max_message_bytes: int = 1 << 20
    app_ws_max_sockets: int = 32
    #: A server-sent event stream (a streamed turn, an exec's output) that has sent nothing for this many seconds
    #: sends a comment line, so proxies and the fleet's forwarding do not cut a quiet stream (0: never).
    sse_keepalive_s: float = 15.0
    #: Seconds a client connection may take to send a request's headers, from its opening or from the previous
    #: answer; past it the server closes the connection (a slow or silent client held it for good before).
    http_header_timeout_s: float = 10.0
    #: Seconds a client may leave its answer unread (the connection's buffers full, nothing taken) before the server
    #: closes the connection: a reader that stopped held the connection, the answer's memory and its stream for good.
    http_write_stall_s: float = 60.0
    #: Per end-user of an agent, per host process (docs/api.md, "Which limits count across the fleet"): requests of
    #: their end-user tokens in flight at once (a stream until it ends), turns admitted at once over all their
    #: sessions, and async turns unfinished at once; past each a 429.
    end_user_max_requests: int = 32
    user_max_turns: int = 128
    user_max_async_turns: int = 64
    #: The most the store may keep for any end-user's instance, in MiB, whatever an agent's or a user's
    #: ``store_mib`` says (a lower one still applies); 0: no ceiling (usage/store_cap.py).
    user_max_store_mib: float = 0
    #: The most one tenant may keep, in MiB: its store and its instances' disk and snapshot bytes at their last
    #: sleep, over all its agents and end-users; past it what would keep more is refused (507). 0: no ceiling
    #: (usage/tenant_cap.py).
    tenant_max_storage_mib: float = 0
    #: Browser origins whose pages may call the API (CORS), comma-separated (``https://app.example.com``): a
    #: product's page using its end-user token. Empty: none (docs/api.md, "Conventions").
    cors_origins: str = ""
    #: Secrets (docs/egress.md): the operator's encryption keys, comma-separated ``id:base64`` (first one
    #: encrypts, all decrypt); empty: the 0600 key file ``secrets.key`` in the data directory, made on first use.
    secrets_keys: str = dataclasses.field(default="", repr=False)
    #: Host uid (and gid) that process sandboxes run as when moorage runs as root; no account should use it
    #: (never 0). Ignored when moorage itself runs unprivileged. QEMU runs as a uid of each sandbox's own
    #: (``sandbox/microvm_user.py``).
    sandbox_uid: int = 64000
    #: Guest-initiated requests (model calls, memory, steps) served at once per sandbox; more are answered busy.
    guest_calls_per_channel: int = 32
    #: Guest-initiated requests served at once per tenant over all its sandboxes; more wait their turn, so one
    #: tenant cannot hold every worker of the host's shared executor.
    guest_calls_per_tenant: int = 8
    #: Host CPU a tenant's guests may make the host spend, sustained, in cores (after a burst of a quarter second),
    #: while another tenant's turns run (now or within the last second; alone, a tenant is never held back): their
    #: calls' worker-thread time and the event loop's time on their frames and calls. Past it the channels of
    #: that tenant's sandboxes are not read until the share refills (the guests wait). The host is one process
    #: whose event loop every tenant's turns go through, so what one tenant's guests make it do delays the others
    #: (runtime/cpu_share.py, sandbox/channel_share.py). A cheap guest call costs the host ~0.5 ms: 0.1 is ~200
    #: calls a second sustained, ~500 at once.
    guest_cpu_share: float = 0.1

    @property
    def images_dir(self) -> Path:
        return self.data_dir / "images"

    @property
    def sandboxes_dir(self) -> Path:
        return self.data_dir / "sandboxes"

    @property
    def fleet(self) -> bool:
        """Whether this host is one of a fleet: instances ship to the object store and any host may wake them."""
        return bool(self.object_store_url) and self.store_url.startswith(("postgres://", "postgresql://"))

    def with_(self, **changes: Any) -> "Config":
        return dataclasses.replace(self, **changes)


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _coerce(name: str, raw: Any, target: Any) -> Any:
    """``raw`` (a TOML value or an environment string) as the setting's type; anything that is not exactly one
    (a truncated float, a word that is neither yes nor no, a boolean given for a number) is refused."""
    try:
        if target is Path or target == "Path":
            return Path(str(raw)).expanduser()
        if isinstance(raw, bool) and target not in (bool, "bool"):
            raise ValueError("a boolean")
        if target is int or target == "int":
            if isinstance(raw, float):
                if not raw.is_integer():
                    raise ValueError("not a whole number")
                return int(raw)
            return int(raw)
        if target is float or target == "float":
            return float(raw)
        if target is bool or target == "bool":
            if isinstance(raw, bool):
                return raw
            word = str(raw).strip().lower()
            if word not in _TRUE + _FALSE:
                raise ValueError("neither true nor false")
            return word in _TRUE
        return str(raw)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config value {name}={raw!r} is not a valid {getattr(target, '__name__', target)}",
                          hint="fix moorage.toml or the MOORAGE_* variable") from e


#: Numbers a setting may take (least, greatest or None); outside them a host would fail later, on every turn,
#: deploy or request, so it does not start. Where 0 means "no limit" the comment on the setting says so.
BOUNDS: dict[str, tuple[float, float | None]] = {
    "port": (0, 65535), "guest_memory_mib": (128, None), "agent_max_memory_mib": (0, None),
    "agent_max_vcpus": (0, None), "agent_max_disk_mib": (0, None), "lease_ttl_s": (0.5, None),
    "heartbeat_s": (0.1, None), "checkpoint_interval_s": (0.1, None), "fleet_cache_mib": (0, None),
    "template_gc_interval_s": (1, None), "template_gc_grace_s": (0, None), "template_gc_settle_s": (0, None),
    "template_prefetch": (0, None), "max_awake_instances": (0, None),
    "max_awake_ram_mib": (0, None), "max_awake_per_tenant": (0, None), "max_value_bytes": (64 << 10, None),
    "egress_max_connections": (1, None), "egress_connects_per_s": (1, None), "egress_bytes_per_s": (0, None),
    "egress_max_bytes": (0, None), "app_max_request_bytes": (1, None), "app_max_response_bytes": (1, None),
    "app_timeout_s": (1, None), "app_max_duration_s": (1, None), "app_ws_max_message_bytes": (1, None),
    "app_ws_max_sockets": (1, None), "sse_keepalive_s": (0, None), "sandbox_uid": (1, None),
    "http_header_timeout_s": (0.1, None), "http_write_stall_s": (0.1, None), "end_user_max_requests": (1, None),
    "user_max_turns": (1, None),
    "user_max_async_turns": (1, None), "user_max_store_mib": (0, None),
    "tenant_max_storage_mib": (0, None),
    "llm_threads": (0, 256),
    "guest_calls_per_channel": (1, None), "guest_calls_per_tenant": (1, None), "guest_cpu_share": (0.01, None),
}


#: An origin as a browser sends it: scheme, host (a name or a bracketed IPv6 address) and port, no path.
ORIGIN = re.compile(r"https?://[A-Za-z0-9.\-]+(:\d{1,5})?|https?://\[[0-9A-Fa-f:.]+\](:\d{1,5})?")


def parse_origins(value: str) -> list[str]:
    """``cors_origins`` as a list; each an origin a browser sends (scheme, host, port: no path, no ``*``)."""
    origins = [o.strip().rstrip("/") for o in value.split(",") if o.strip()]
    for origin in origins:
        if not ORIGIN.fullmatch(origin.lower()):
            raise ConfigError(f"cors_origins: {origin!r} is not an origin",
                              hint="name each page's origin as a browser sends it, e.g. https://app.example.com or "
                                   "http://127.0.0.1:8002, comma-separated (no path, no '*')")
    # As a browser sends it: lower case, no default port (https://App.example.com:443 matched no page before).
    return [re.sub(r"^(https://[^/]+):443$|^(http://[^/]+):80$", lambda m: m.group(1) or m.group(2), o.lower())
            for o in origins]


def _check_words(values: dict[str, Any]) -> None:
    """Settings whose form is known: refused at start rather than on each request that would use them."""
    endpoint = values.get("otlp_endpoint")
    if endpoint and not re.fullmatch(r"https?://[^\s/]+(/\S*)?", str(endpoint)):
        raise ConfigError(f"otlp_endpoint={endpoint!r} is not an http(s) URL",
                          hint="e.g. http://127.0.0.1:4318/v1/traces, or leave it empty")
    if values.get("cors_origins"):
        parse_origins(str(values["cors_origins"]))  # ConfigError naming the value that is not an origin
    if values.get("secrets_keys"):
        from moorage.secrets.keyring import parse_keys

        parse_keys(str(values["secrets_keys"]), "secrets_keys")  # ConfigError naming what is wrong with a key


def _check_numbers(values: dict[str, Any]) -> None:
    for name, (least, most) in BOUNDS.items():
        value = values.get(name)
        if value is None:
            continue
        if value < least or (most is not None and value > most):
            span = f"from {least:g} to {most:g}" if most is not None else f"at least {least:g}"
            raise ConfigError(f"{name}={value:g} is out of range: it must be {span}",
                              hint=f"fix {name} in moorage.toml or MOORAGE_{name.upper()}")
    cap, default = values.get("agent_max_memory_mib") or 0, values.get("guest_memory_mib", 256)
    if cap and cap < default:
        raise ConfigError(f"agent_max_memory_mib={cap} is less than guest_memory_mib={default}, what an agent that "
                          "names no memory_mib gets: no such agent could deploy",
                          hint="raise agent_max_memory_mib or lower guest_memory_mib")


#: The settings that take one of a few words; anything else is refused at start, never silently replaced.
CHOICES: dict[str, tuple[str, ...]] = {
    "shutdown": ("sleep", "detach"),
    "accel": ("auto", "kvm", "tcg"),
    "memory_summarizer": ("extractive", "model"),
    "memory_extractor": ("patterns", "model"),
    "log_level": ("debug", "info", "warning", "error"),
    "log_format": ("text", "json"),
}
_DEFAULTS = {f.name: f.default for f in fields(Config) if f.name in CHOICES}


#: Settings that name a file or directory on this machine. Written relative in a config file, they are taken
#: relative to that file's directory (the file can move with what it names); from the environment or a flag,
#: relative to the working directory, as a shell would. ``store_url`` is one when it is ``sqlite:PATH``.
PATH_SETTINGS = ("data_dir", "llm_policy")


def _from_file_dir(name: str, value: Any, file_dir: Path) -> Any:
    """``value`` of setting ``name`` read from a config file in ``file_dir``, a relative path made absolute there."""
    if name == "store_url" and isinstance(value, str) and value.startswith("sqlite:"):
        rest = value.removeprefix("sqlite:").removeprefix("//")  # as moorage.store.open_backend reads it
        return f"sqlite:{_from_file_dir('data_dir', Path(rest), file_dir)}" if rest else value
    if name not in PATH_SETTINGS or value in ("", None):
        return value
    p = Path(str(value)).expanduser()
    p = p if p.is_absolute() else file_dir / p
    return p if isinstance(value, Path) else str(p)


def load(path: Path | None = None, env: Mapping[str, str] | None = None, **overrides: Any) -> Config:
    """Read configuration once. ``path`` defaults to ``$MOORAGE_CONFIG`` or ``./moorage.toml`` if it exists.

    In the file, settings live under a ``[moorage]`` table (an agent's ``[agent]`` table may share the file);
    a relative path there (``PATH_SETTINGS``, ``store_url = "sqlite:PATH"``) is relative to the file's directory.
    """
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    types = {f.name: f.type for f in fields(Config)}

    cfg_path = path or (Path(env["MOORAGE_CONFIG"]) if env.get("MOORAGE_CONFIG") else Path("moorage.toml"))
    if cfg_path.exists():
        try:
            doc = tomllib.loads(cfg_path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{cfg_path} is not valid TOML: {e}") from e
        section = doc.get("moorage", {})
        file_dir = cfg_path.resolve().parent
        for k, v in section.items():
            if k not in types:
                raise ConfigError(f"unknown setting {k!r} in {cfg_path}", hint=f"known settings: {', '.join(sorted(types))}")
            values[k] = _from_file_dir(k, _coerce(k, v, types[k]), file_dir)
    elif path is not None or env.get("MOORAGE_CONFIG"):
        raise ConfigError(f"config file {cfg_path} does not exist",
                          hint="fix --config or MOORAGE_CONFIG (without either, ./moorage.toml is read if it exists)")

    for name, typ in types.items():
        key = "MOORAGE_" + name.upper()
        if key in env and env[key] != "":
            values[name] = _coerce(key, env[key], typ)
    for k, v in overrides.items():
        if v is not None:
            values[k] = _coerce(k, v, types[k])
    values.setdefault("data_dir", _default_data_dir(env))  # from the environment load() was given
    _check_numbers(values)
    _check_words(values)
    if isinstance(values.get("log_level"), str):
        values["log_level"] = values["log_level"].lower()  # INFO as well as info
    for name, choices in CHOICES.items():
        value = values.get(name, _DEFAULTS[name])
        if value not in choices:
            raise ConfigError(f"{name}={value!r} is not one of {', '.join(choices)}",
                              hint=f"set {name} = \"{_DEFAULTS[name]}\" (default) or another of those in moorage.toml "
                                   f"or MOORAGE_{name.upper()}")
    if float(values.get("template_prefetch_interval_s", 60.0)) <= 0:
        raise ConfigError("template_prefetch_interval_s must be more than 0",
                          hint="set template_prefetch = 0 to fetch templates only when a wake needs them")
    return Config(**values)
