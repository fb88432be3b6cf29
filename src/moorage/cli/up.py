"""``moorage up``: one host with the embedded defaults, serving the HTTP API; optionally a first-run demo.

On first start it creates a ``local`` tenant and writes its admin key to ``<data_dir>/local-admin.key``; while it
serves, ``<data_dir>/moorage-up.json`` says where (the CLI and ``Client()`` on this machine find it there).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import signal
import tarfile
from pathlib import Path

import httpx
from rich.markup import escape

from moorage.cli.console import make_console
from moorage.client._local import forget_serving, local_url, record_serving
from moorage.config import Config
from moorage.log import get_logger

log = get_logger(__name__)
console = make_console()

LOCAL_TENANT = "local"

#: What a host does not import before it serves, and why: every second of a start is downtime for the host's users
#: (an upgrade, a crash). Each is imported by the first request or the configuration that needs it;
#: ``tests/cli/test_up_imports.py`` checks that a started host holds none of them.
LAZY_IMPORTS = {
    "mcp": "the MCP SDK, about half a second of pydantic models: the first MCP request imports it "
           "(api/mcp.py, in a worker thread)",
    "langgraph": "the LangGraph checkpointer for a graph in the developer's own process (store/langgraph.py); "
                 "a graph in a sandbox imports LangGraph there, never in the host",
    "opentelemetry": "the OTLP exporter (observability/otlp.py), imported only when one is configured",
    "psycopg": "PostgreSQL's driver, for a host whose store is PostgreSQL (store/postgres.py); its outage error is "
               "moorage.errors.StoreUnreachable, so the lifecycle and webhooks catch it without the driver",
}


def admin_key_path(cfg: Config) -> Path:
    return cfg.data_dir / "local-admin.key"


def ensure_local_tenant(host: object, cfg: Config) -> str:
    """The local tenant's admin key, creating tenant and key on the first start, and again after the operator
    deleted the local tenant (``moorage store delete-tenant local``: the key written before is a dead one)."""
    path = admin_key_path(cfg)
    store = host.store  # type: ignore[attr-defined]
    from moorage.errors import ConflictError, NotFound

    if path.exists():
        try:
            store.operator.get_tenant(LOCAL_TENANT)
            return path.read_text().strip()
        except NotFound:
            log.info("the local tenant was deleted: making a new one", key_file=str(path))
        except Exception:  # noqa: BLE001 - the store cannot say now (it is down): the key written before stands
            return path.read_text().strip()
    try:
        tenant = store.operator.get_tenant(LOCAL_TENANT)
        key = store.backend.create_api_key(tenant.id, ["admin"], "moorage up (replacement local key)")
    except NotFound:
        try:
            _, key = store.operator.create_tenant(LOCAL_TENANT)
        except ConflictError:  # another host of the fleet made it first
            key = store.backend.create_api_key(store.operator.get_tenant(LOCAL_TENANT).id, ["admin"],
                                               "moorage up (replacement local key)")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.secret + "\n")
    return key.secret


def tar_dir(path: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for p in sorted(path.rglob("*")):
            if p.is_file() and "__pycache__" not in p.parts:
                tar.add(p, arcname=p.relative_to(path).as_posix())
    return buf.getvalue()


DEMO_TURNS = [
    ("monday", "Hi! My name is Ada and I prefer green tea over coffee."),
    ("friday", "What do I prefer to drink?"),
]


def _raise_for(r: httpx.Response, what: str) -> None:
    if r.is_success:
        return
    from moorage.errors import MoorageError

    try:
        problem = r.json()
    except ValueError:
        problem = {"detail": r.text[:500]}
    raise MoorageError(f"{what} failed: {r.status_code} {problem.get('detail')}", hint=problem.get("hint"))


def hold_data_dir(cfg: Config) -> int:
    """Take the data directory for this process (a lock held until it exits): two hosts on one data directory
    would drive the same sandboxes. Returns the lock's file descriptor."""
    import fcntl

    from moorage.errors import ConfigError
    from moorage.runtime.private_files import data_dir

    fd = os.open(data_dir(cfg.data_dir) / "moorage-up.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise ConfigError(f"the data directory {cfg.data_dir} is in use by another moorage host (pid {holder})",
                          hint="stop it first, or give this one its own data_dir / MOORAGE_DATA_DIR") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def check_demo(demo: Path | None, exit_after_demo: bool) -> None:
    """Before anything starts: the demo's folder is an agent, and --exit-after-demo comes with a demo."""
    from moorage.errors import ConfigError

    if demo is None:
        if exit_after_demo:
            raise ConfigError("--exit-after-demo needs --demo <agent folder>")
        return
    if not (demo / "moorage.toml").is_file():
        raise ConfigError(f"--demo {demo}: no agent folder there (it needs a moorage.toml)",
                          hint="e.g. --demo examples/assistant")


async def run_demo(url: str, key: str, agent_dir: Path) -> None:
    """Deploy the example agent through the API and hold a two-session conversation with it."""
    import tomllib

    name = tomllib.loads((agent_dir / "moorage.toml").read_text())["agent"]["name"]
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600) as client:
        with console.status(f"deploying {agent_dir} (builds its template sandbox)…"):
            r = await client.post(f"/v1/agents/{name}/deployments", content=tar_dir(agent_dir),
                                  headers={"Content-Type": "application/gzip"})
        _raise_for(r, f"deploying {agent_dir}")
        console.print(f"[green]deployed[/] {name} #{r.json()['number']}")
        for session, text in DEMO_TURNS:
            console.print(f"[bold]ada[/] ({session}): {text}")
            with console.status("thinking…"):
                r = await client.post(f"/v1/agents/{name}/invoke", json={"user": "ada", "session": session, "message": text})
            _raise_for(r, "the demo's turn")
            console.print(f"[bold]{name}[/]: {r.json()['reply']}", highlight=False)


def bound_port(server: object, default: int) -> int:
    """The port uvicorn listens on (port 0 asks the kernel for one)."""
    for srv in getattr(server, "servers", None) or []:
        for sock in srv.sockets:
            return int(sock.getsockname()[1])
    return default


def loopback_only(host: str) -> bool:
    """Whether a server listening on ``host`` is reached from this machine alone."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: whatever it resolves to, it may be another interface's


def check_port(cfg: Config) -> None:
    """Refuse, before any instance is started, an address another process listens on (uvicorn would stop later
    with its own log line and exit status 3)."""
    import socket

    from moorage.errors import ConfigError

    try:
        infos = socket.getaddrinfo(cfg.host, cfg.port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise ConfigError(f"cannot use host {cfg.host!r}: {e}", hint="fix --host / MOORAGE_HOST") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a closed port is free
        try:
            probe.bind(address)
        except OSError as e:
            raise ConfigError(f"cannot listen on {cfg.host}:{cfg.port}: {e.strerror or e}",
                              hint="stop what serves there, or choose another port with --port / MOORAGE_PORT") from None


async def serve(cfg: Config, demo: Path | None, exit_after_demo: bool) -> None:
    import uvicorn

    from moorage.api.app import create_app
    from moorage.api.server import header_deadline
    from moorage.fds import raise_open_files_limit
    from moorage.runtime.admin_socket import AdminSocket
    from moorage.runtime.allocator import keep_large_blocks_mapped
    from moorage.runtime.backup import refuse_incomplete
    from moorage.runtime.host import Host

    keep_large_blocks_mapped()  # a host runs for months: what its threads free goes back to the kernel
    raise_open_files_limit()  # whatever its store: sandboxes and connections hold descriptors too
    check_demo(demo, exit_after_demo)
    refuse_incomplete(cfg.data_dir)  # an online backup that never finished is no data directory to serve
    hold_data_dir(cfg)  # released when this process ends, however it ends
    check_port(cfg)
    host = Host.open(cfg)
    key = ensure_local_tenant(host, cfg)
    if host.manager.fleet is not None:  # a host whose secrets differ from the fleet's is refused as it joins
        from moorage.api.auth import installation_fingerprints

        host.manager.fleet.secrets = installation_fingerprints(cfg)
    await host.start()
    admin = AdminSocket(host)  # local operator requests: `moorage backup` while this runs
    await admin.start()
    app = create_app(host.runtime, cfg, span_sink=host.span_sink)
    # A WebSocket message past the apps' cap is refused by the server itself, before it is buffered (docs/app.md).
    server = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning", lifespan="off",
                                           ws_max_size=cfg.app_ws_max_message_bytes,  # inclusive: a message of the cap passes
                                           http=header_deadline(cfg.http_header_timeout_s, cfg.http_write_stall_s)))

    async def after_start() -> None:
        while not server.started:
            await asyncio.sleep(0.05)
        port = bound_port(server, cfg.port)  # the kernel's choice for port 0
        url = f"http://[{cfg.host}]:{port}" if ":" in cfg.host else f"http://{cfg.host}:{port}"
        # Where clients on this machine reach it (the port it got, a wildcard address on loopback): a CLI or a
        # Client() given no URL comes here, not to the default port.
        record_serving(cfg.data_dir, local_url(cfg.host, port))
        console.print(f"moorage is up at [bold]{url}[/] (store: {host.store.describe()}; sandboxes: {host.driver.name})")
        console.print(f"local tenant admin key: {admin_key_path(cfg)}")
        if not loopback_only(cfg.host):
            console.print("[yellow]plain HTTP beyond this machine:[/] API keys and end-user tokens cross the network "
                          "unencrypted; put a TLS proxy in front (docs/operations.md, \"Serve it over HTTPS\")")
        if cfg.shutdown == "detach" and not host.driver.capabilities.survives_host_exit:
            console.print(f"[yellow]--detach has no effect here:[/] {host.driver.name} sandboxes end with the host; "
                          "on stop they are put to sleep")
        if demo is not None:
            from moorage.errors import MoorageError

            try:
                await run_demo(local_url(cfg.host, port), key, demo)
            except MoorageError as e:
                if exit_after_demo:
                    raise  # the command's own error: printed once, exit status 2
                console.print(f"[red]the demo failed:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
            finally:
                if exit_after_demo:
                    server.should_exit = True
        if not exit_after_demo:
            console.print("serving; Ctrl-C to stop")

    # uvicorn turns SIGTERM/SIGINT into a graceful stop, then raises the signal again once it has stopped serving.
    # With the default handlers back in place that would kill this process before the host could put its awake
    # instances to sleep; these handlers make that second delivery a no-op, so the clean stop below always runs.
    def stop_serving(sig: int, frame: object) -> None:
        server.should_exit = True

    # While it serves, uvicorn's own handler takes the signal (and drains requests before ``serve`` returns): an
    # online backup is stopped as the signal arrives, not after a long turn in flight ended (it would run on, and
    # finish, while the host is stopping).
    # Detached execs and agent apps' answers end as the signal arrives too (``Host.stopping``): a client following
    # an exec or an app's event stream kept uvicorn's graceful stop waiting until it ended (an exec's timeout_s,
    # an app's app_max_duration_s) before any instance was put to sleep.
    loop = asyncio.get_running_loop()
    uvicorn_exit = server.handle_exit
    ending: list[asyncio.Task[int]] = []

    def begin_stop() -> None:
        if not ending:
            ending.append(asyncio.create_task(host.stopping()))

    def handle_exit(sig: int, frame: object) -> None:
        loop.call_soon_threadsafe(admin.stop_backup)
        loop.call_soon_threadsafe(begin_stop)
        uvicorn_exit(sig, frame)

    server.handle_exit = handle_exit  # type: ignore[method-assign]

    previous = {sig: signal.signal(sig, stop_serving) for sig in (signal.SIGTERM, signal.SIGINT)}
    task = asyncio.create_task(after_start())
    try:
        await server.serve()
    finally:
        forget_serving(cfg.data_dir)  # it serves no more (a crash leaves it, naming a pid that is gone)
        if not task.done():
            task.cancel()
        if cfg.shutdown == "detach" and host.driver.capabilities.survives_host_exit:
            how = "leaving instances running (detach)"
        elif cfg.shutdown == "detach":
            how = f"putting awake instances to sleep ({host.driver.name} sandboxes end with the host, so none is detached)"
        else:
            how = "putting awake instances to sleep"
        console.print(f"moorage is stopping: {how}")
        try:
            if ending:
                with contextlib.suppress(Exception):
                    await ending[0]
            await admin.close()
            await host.close()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    if task.done() and not task.cancelled() and task.exception():
        raise task.exception()  # type: ignore[misc]
