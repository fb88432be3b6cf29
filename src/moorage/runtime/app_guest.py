"""Reaching an agent's app inside the user's sandbox: its port, one relayed guest connection to it (``app.open`` in
``guest/app_relay.py``), and which headers pass between caller and app; used by the HTTP and the WebSocket relay."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Iterable

from moorage.errors import NotFound
from moorage.runtime.app_errors import AppBusy, AppUnavailable, OnWakeTimeout
from moorage.runtime.package import turn_timeout_s
from moorage.runtime.sizing import app_ports
from moorage.sandbox import RemoteError
from moorage.store import EntityKey, Scope, TenantStore

#: How long after the agent's code was loaded its app may take to listen on its port (its module starts the server).
APP_BIND_S = 10.0
#: The guest relay's error code for "nothing listens on that port" (guest/app_relay.py).
APP_UNREACHABLE = -32020
#: ... and for "as many connections to the app are open as the guest allows" (its MAX_CONNECTIONS, 64).
APP_BUSY = -32021
#: ... and for "the agent's on_wake did not return within ``wake_wait_s``" (it goes on running in the guest).
ON_WAKE_TIMEOUT = -32022
#: ... and for "on_wake is due and needs the secrets the agent opted into its environment" (``secret_env``).
NEEDS_SECRET_ENV = -32023
#: How long ``app.open`` may take besides the wait for ``on_wake``: the guest's connect to the port gives up at 10 s.
OPEN_S = 15.0
#: Bytes asked of the guest per read (its own cap is the same).
READ_CHUNK = 512 * 1024
#: Largest request chunk sent in one frame.
WRITE_CHUNK = 256 * 1024

#: Request headers never passed to the app: hop-by-hop, the caller's credentials for moorage (an API key or
#: cookies of the API's origin are not the app's business), and what the host sets itself (``origin_for``).
DROP_REQUEST = frozenset({
    "connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade", "host",
    "authorization", "proxy-authorization", "cookie", "content-length", "expect", "x-forwarded-for",
    "x-forwarded-host", "x-forwarded-proto", "x-forwarded-prefix", "forwarded", "origin",
})

#: The app's answer headers never passed back (an HTTP answer's, a WebSocket's 101): hop-by-hop, framing (the host
#: re-frames), cookies (the app is served from the API's origin, where it must not set or replace cookies), and the
#: two the host's server adds itself (``server``, ``date``: one of each, as a proxy sends).
DROP_RESPONSE = frozenset({
    "connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade",
    "set-cookie", "set-cookie2", "proxy-authenticate", "content-security-policy", "strict-transport-security",
    "referrer-policy", "server", "date",
})


def origin_for(headers: Iterable[tuple[bytes, bytes]], port: int) -> list[str]:
    """The ``Origin`` the app sees: its own, as its ``Host`` is, when the caller sent one. A page of the app runs in an
    opaque origin (``null``, the sandbox CSP) and the API's origin is not the app's: a same-origin check in the app
    (Tornado's, engine.io's) would refuse every browser. It guards nothing here: the app never sees cookies."""
    return [own_origin(port)] if any(k.lower() == b"origin" for k, _ in headers) else []


def own_origin(port: int) -> str:
    return f"http://127.0.0.1:{port}"


async def app_of(runtime: Any, ts: TenantStore, agent_name: str, user: str) -> tuple[Any, Any, Any, Any, int]:
    """(agent, lifecycle, scope, live deployment, app port) of ``user``'s instance; NotFound if it serves no app."""
    agent, lc, scope = await asyncio.to_thread(runtime.router.resolve, ts, EntityKey(agent_name, user, "default"))
    if agent.live_deployment is None:
        raise NotFound(f"agent {agent_name!r} has no live deployment", hint="deploy it with `moorage deploy`")
    deployment = await asyncio.to_thread(ts.deployments.get, agent.live_deployment)
    ports = app_ports(deployment.manifest)
    if not ports:
        raise NotFound(f"agent {agent_name!r} serves no app", hint='declare its port in moorage.toml: ports = [8080]')
    await _within_compute_cap(runtime, ts, agent_name, user)
    return agent, lc, scope, deployment, ports[0]


async def _within_compute_cap(runtime: Any, ts: TenantStore, agent_name: str, user: str) -> None:
    """An app's request or socket wakes the instance like a turn, so a user over ``compute_seconds_per_day`` is
    refused (429, and the instance put to sleep) as their turn is; before, the app route woke it again and again past
    the cap. Only the compute cap: tokens and cost are spent by turns (a page saying the credits ran out still
    shows)."""
    from moorage.usage import caps

    now = time.time()
    cap = (await asyncio.to_thread(caps.standing, ts, agent_name, user, now=now)).get("compute_seconds_per_day")
    if cap is None or cap["used"] < cap["limit"]:
        return
    await runtime.instances.sleep(ts, Scope.for_user(agent_name, user), reason="compute cap reached")
    raise caps.CapExceeded(agent_name, user, "compute_seconds_per_day", cap["limit"], cap["used"], cap["resets_at"], now)


async def open_connection(runtime: Any, sandbox: Any, deployment: Any, port: int, *, ts: Any, agent_name: str,
                          user: str, on_restart: Any = None, **options: Any) -> dict[str, Any]:
    """A guest connection to the app's port (``options`` go to ``app.open``). A guest that booted without the
    agent's code (a sandbox whose processes did not survive its sleep, a cold boot) gets it loaded first, which
    starts an app the agent module runs, and is asked again for a few seconds while the app binds its port.
    Loading may restart the sandbox for the deployment's packages (``instance_update``; ``on_restart`` gets the
    new channel). A guest whose ``on_wake`` is due asks for the secrets ``user``'s instance of ``agent_name`` opted
    into its environment, and gets them as a turn does (before, on_wake ran without them when an app request woke
    the sandbox)."""
    from moorage.runtime import instance_update

    if instance_update.guest_code_behind(runtime, sandbox):
        # An older moorage's guest code (a micro-VM re-adopted after an upgrade, woken from an older snapshot): it is
        # restarted onto this host's and the agent's code loaded again, as before a turn, so an app request is not
        # served by it (before, only a turn brought it up to date). A read of the sandbox's record, in memory.
        await instance_update.load(runtime, sandbox, deployment, ts, on_restart=on_restart)
        runtime._loaded[sandbox.id] = deployment.id
    if runtime._loaded.get(sandbox.id) is None:
        # This host process has not used the sandbox yet (re-adopted after `moorage up --detach`, or woken from a
        # snapshot an earlier host process made): its guest says what is loaded, which may be an older deployment
        # whose app still serves that code's page.
        info = await sandbox.channel.call("agent.info", {}, timeout=15)
        have = info.get("loaded") if isinstance(info, dict) else None
        if isinstance(have, list) and have:
            runtime._loaded[sandbox.id] = deployment.id if deployment.id in have else str(have[0])
    if runtime._loaded.get(sandbox.id) not in (None, deployment.id):
        # Another deployment's code is loaded here (a redeploy since its last turn): load this one first, which
        # restarts an app whose server the old module started (instance_update), so the page is the live code's.
        await instance_update.load(runtime, sandbox, deployment, ts, on_restart=on_restart)
        runtime._loaded[sandbox.id] = deployment.id
    loaded = False
    give_up = time.monotonic() + 10
    # The guest runs the agent's on_wake first when it is due, and waits for it at most this long: the agent's own
    # bound on its code's runs, or the app's on an answer if shorter (before, the host's channel gave up after 15 s
    # with an error that named nothing, and so did every later request while on_wake still ran).
    wake_wait_s = min(turn_timeout_s(deployment.manifest), float(runtime.config.app_timeout_s))
    secret_env: dict[str, Any] = {}
    while True:
        try:
            return await sandbox.channel.call("app.open", {"port": port, "wake_wait_s": wake_wait_s, **options,
                                                           **secret_env}, timeout=wake_wait_s + OPEN_S)
        except RemoteError as e:
            if e.rpc_code == NEEDS_SECRET_ENV and not secret_env:
                secret_env = {"secret_env": await _secret_env(runtime, ts, deployment, agent_name, user)}
                continue
            if e.rpc_code == ON_WAKE_TIMEOUT:
                raise OnWakeTimeout(wake_wait_s) from None
            if e.rpc_code == APP_BUSY:
                raise AppBusy("the agent's app has too many open connections",
                              hint="retry in a moment, or close some of its WebSockets") from None
            if e.rpc_code != APP_UNREACHABLE:
                raise AppUnavailable("the sandbox could not reach the agent's app") from None
        if not loaded:
            info = await sandbox.channel.call("agent.info", {}, timeout=15)
            if deployment.id not in (info.get("loaded") or [] if isinstance(info, dict) else []):
                await instance_update.load(runtime, sandbox, deployment, ts, on_restart=on_restart)
                runtime._loaded[sandbox.id] = deployment.id
                loaded = True
                continue
            loaded = True
            # Its code is loaded and still nothing listens: the app is down, unless its code was loaded just now (a
            # redeploy's restart, by this request or a turn before it) and its server is still binding the port.
            since = instance_update.loaded_at(sandbox.id)
            give_up = time.monotonic() if since is None else min(give_up, since + APP_BIND_S)
        if time.monotonic() >= give_up:
            raise AppUnavailable(f"the agent's app is not listening on port {port}",
                                 hint=f"start a server on 127.0.0.1:{port} in the sandbox")
        await asyncio.sleep(0.1)


async def _secret_env(runtime: Any, ts: Any, deployment: Any, agent_name: str, user: str) -> dict[str, str]:
    """The secrets the deployment opted into the guest's environment (``[agent.secrets] env``), as a turn's guest
    gets them (``host_calls.secrets_env``)."""
    from moorage.runtime.host_calls import secrets_of
    from moorage.secrets import Bindings

    bindings = Bindings.from_manifest(deployment.manifest)
    if not bindings.env:
        return {}
    return await asyncio.to_thread(secrets_of(runtime).env, ts, agent_name, user, bindings)
