"""The supervisor: finds its transport (unix socket, inherited fd or virtio-serial port), serves the registry.

Built-in methods: ping, exec, fs.*, sys.sync, sys.shutdown, sys.restart (a VM's). Extensions add theirs via
``--extension MODULE``.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import importlib
import os
import select
import signal
import socket
import sys
import time
import uuid
from typing import Any, List, Optional, Set

from . import agent, children, egress_relay, ops_exec, ops_fs, packages, restart
from .rpc import INVALID_PARAMS, MAX_FRAME, Context, Peer, Registry, RpcError, log

VIRTIO_PORT_NAME = "moorage.0"


def find_virtio_port(name: str = VIRTIO_PORT_NAME) -> Optional[str]:
    """The /dev path of the virtio-serial port called ``name`` (the index in /dev/vportNpM follows device order)."""
    for name_file in glob.glob("/sys/class/virtio-ports/*/name"):
        try:
            with open(name_file) as f:
                if f.read().strip() == name:
                    return "/dev/" + os.path.basename(os.path.dirname(name_file))
        except OSError:
            continue
    return None


#: Where a VM's supervisor records the guest kernel's OOM-kill count as it starts (/run: a tmpfs, gone at a boot).
OOM_KILLS_FILE = "/run/moorage/oom-kills"


def _oom_kills() -> Optional[int]:
    """The guest kernel's count of processes it killed for memory (``/proc/vmstat``'s ``oom_kill``)."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def oom_killed_since_last_start() -> bool:
    """Whether the guest's kernel killed a process for memory since the supervisor before this one started (a VM's
    init starts a new one when one ends): what the host says of that one's end. This one's count is kept for the
    next. Only words for the host's message hang on it: the guest is not trusted with anything more."""
    now = _oom_kills()
    try:
        with open(OOM_KILLS_FILE) as f:
            before = int(f.read().strip())  # type: Optional[int]
    except (OSError, ValueError):
        before = None
    if now is not None:
        try:
            os.makedirs(os.path.dirname(OOM_KILLS_FILE), exist_ok=True)
            with open(OOM_KILLS_FILE, "w") as f:
                f.write(str(now))
        except OSError:
            pass
    return now is not None and before is not None and now > before


def _then_woken(after_wake: Any, runtime: Any) -> Any:
    async def handler(params: Any, ctx: Context) -> Any:
        result = await after_wake(params, ctx)
        runtime.woken()
        return result

    return handler


class Supervisor:
    def __init__(self, workdir: str, extensions: List[str]) -> None:
        self.workdir = workdir
        self.registry = Registry()
        self.boot_id = uuid.uuid4().hex
        self.started = time.monotonic()
        self.peers: Set[Peer] = set()
        self.stopping = asyncio.Event()
        #: The environment this supervisor started with, before anything below configured it (``sys.restart``).
        self.base_env = dict(os.environ)
        #: A VM's: the supervisor before this one was ended by the guest kernel's OOM killer (``ping``).
        self.after_oom_kill: Optional[bool] = None
        self.registry.add("ping", self.ping)
        self.registry.add("sys.sync", self.sync)
        self.registry.add("sys.shutdown", self.shutdown)
        # A network agent's NIC comes up first, so every process (and the agent) gets its proxy settings.
        egress_relay.configure(os.environ)
        packages.configure(os.environ)
        ops_exec.register(self.registry, dict(os.environ), workdir)
        ops_fs.register(self.registry, workdir)
        # Extensions that call the host outside a request (guest/egress_relay.py) use whichever peer is open.
        self.registry.peers = self.peers  # type: ignore[attr-defined]
        for name in extensions:
            self._load_extension(name)
        # A VM's wake (its extension's ``vm.after_wake``) makes the agent's on_wake due again (guest/agent.py).
        after_wake = self.registry.get("vm.after_wake")
        if after_wake is not None and agent.RUNTIME is not None:
            self.registry.add("vm.after_wake", _then_woken(after_wake, agent.RUNTIME))

    def _load_extension(self, name: str) -> None:
        # A bare name is a module of this package ("agent" -> guest.agent); a dotted name is imported as is.
        full = name if "." in name else "%s.%s" % (__package__, name)
        try:
            module = importlib.import_module(full)
            module.register(self.registry)
        except Exception as e:
            # A broken or missing extension must not take exec/fs down with it: the host still reaches the
            # sandbox and sees the gap in ping's method list.
            log("extension failed to load", module=full, error="%s: %s" % (type(e).__name__, e))
            return
        log("extension loaded", module=full)

    async def ping(self, params: Any, ctx: Context) -> dict:
        return {
            "pong": True,
            "pid": os.getpid(),
            "boot_id": self.boot_id,
            "uptime_s": time.monotonic() - self.started,
            "methods": self.registry.names(),
            "python": sys.version.split()[0],
            "interpreter": restart.INTERPRETER,
            "after_oom_kill": self.after_oom_kill,
        }

    async def sync(self, params: Any, ctx: Context) -> dict:
        await asyncio.get_running_loop().run_in_executor(None, os.sync)
        return {}

    async def shutdown(self, params: Any, ctx: Context) -> dict:
        # Answer first, then stop: the host waits for the answer before it tears the sandbox down.
        asyncio.get_running_loop().call_later(0.05, self.stopping.set)
        return {}

    async def restart(self, params: Any, ctx: Context) -> dict:
        """Answer, then every other process of the guest is killed and a fresh supervisor started (forked by the
        holder, or executed afresh: guest/restart.py), with ``env`` (the new spec's; absent: the same) in place of the
        old spec's keys named in ``unset``."""
        params = params or {}
        env, unset = params.get("env"), params.get("unset") or []
        if env is not None and not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                                   for k, v in env.items())):
            raise RpcError("env must be an object of strings", INVALID_PARAMS)
        if not (isinstance(unset, list) and all(isinstance(k, str) for k in unset)):
            raise RpcError("unset must be a list of strings", INVALID_PARAMS)
        asyncio.get_running_loop().call_later(0.05, restart.request, self.base_env, env, unset)
        return {"boot_id": self.boot_id}

    async def serve_stream(self, reader: asyncio.StreamReader, writer: Any) -> str:
        peer = Peer(reader, writer, self.registry)
        self.peers.add(peer)
        try:
            return await peer.serve()
        finally:
            self.peers.discard(peer)

    # --- transports -------------------------------------------------------------------------------------------

    async def run_unix(self, path: str) -> None:
        if os.path.exists(path):
            os.unlink(path)  # stale socket from a previous boot of this sandbox
        async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            reason = await self.serve_stream(reader, writer)
            log("connection ended", reason=reason)
        server = await asyncio.start_unix_server(on_conn, path, limit=MAX_FRAME + 16)
        log("listening", path=path, pid=os.getpid())
        async with server:
            await self.stopping.wait()

    async def run_fd(self, fd: int) -> None:
        sock = socket.socket(fileno=fd)
        reader, writer = await asyncio.open_connection(sock=sock, limit=MAX_FRAME + 16)
        serve = asyncio.ensure_future(self.serve_stream(reader, writer))
        stop = asyncio.ensure_future(self.stopping.wait())
        await asyncio.wait([serve, stop], return_when=asyncio.FIRST_COMPLETED)
        serve.cancel()
        stop.cancel()

    async def run_virtio(self, name: str) -> None:
        # Only a VM's supervisor restarts in place: it is the guest's one service (a process sandbox's has a zygote).
        self.registry.add("sys.restart", self.restart)
        loop = asyncio.get_running_loop()
        while not self.stopping.is_set():
            dev = find_virtio_port(name)
            if dev is None:
                log("virtio port not found yet", name=name)
                await asyncio.sleep(0.5)
                continue
            rfd = os.open(dev, os.O_RDWR | os.O_NONBLOCK)
            wfd = os.dup(rfd)
            reader = asyncio.StreamReader(limit=MAX_FRAME + 16)
            rtrans, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(rfd, "rb", 0))
            wtrans, wproto = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, os.fdopen(wfd, "wb", 0))
            writer = asyncio.StreamWriter(wtrans, wproto, reader, loop)
            log("serving virtio port", device=dev)
            reason = await self.serve_stream(reader, writer)
            rtrans.close()
            wtrans.close()
            # The host disconnected (or a bad frame): reopen so the next host connection starts clean.
            log("virtio connection ended", reason=reason)
            await asyncio.sleep(0.05)


def preload(modules: List[str]) -> None:
    """Import what each supervisor loads (stdlib-only guest modules) in a process that forks supervisors."""
    for name in modules:
        try:
            importlib.import_module(f"{__package__}.{name}")
        except Exception as e:  # the supervisor reports it when it loads the extension
            log("could not preload a module", module=name, error=str(e))


def zygote(fd: int, modules: List[str]) -> None:
    """Process driver: this process (imports done, no event loop, no agent code) stays as the sandbox's first
    process and forks each supervisor from itself; it returns only in a supervisor child.

    ``fd`` is a socket whose other end only the host holds (the child closes it, so agent code never sees it).
    The host sends ``K``: the running supervisor is killed and reaped (answer ``k``); then ``G``: a fresh one is
    forked. A rollback restarts the agent this way in a few milliseconds, without a new sandbox or interpreter.
    A supervisor that ends on its own ends the sandbox, as it would without a zygote. When the host's end closes
    (its handle on the sandbox went away; the sandbox itself may live on) the zygote only waits for the supervisor."""
    preload(modules)
    ctl: Optional[socket.socket] = socket.socket(fileno=fd)
    while True:
        pid = os.fork()
        if pid == 0:
            if ctl is not None:
                ctl.close()
            return
        pidfd = os.pidfd_open(pid)
        while True:
            ready, _, _ = select.select([pidfd] if ctl is None else [ctl, pidfd], [], [])
            if pidfd in ready:
                _, status = os.waitpid(pid, 0)
                code = os.waitstatus_to_exitcode(status)
                os._exit(code if code >= 0 else 128 - code)
            assert ctl is not None
            cmd = ctl.recv(1)
            if cmd == b"":
                ctl.close()
                ctl = None
                continue
            if cmd == b"K":
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                os.close(pidfd)
                ctl.sendall(b"k")
                if ctl.recv(1) != b"G":
                    os._exit(0)  # the host went away mid-restart: nothing is left to serve
                break


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="moorage-guest", description="moorage guest supervisor")
    t = ap.add_mutually_exclusive_group(required=True)
    t.add_argument("--listen", metavar="PATH", help="serve on a unix socket (process driver)")
    t.add_argument("--fd", type=int, metavar="N", help="serve an inherited connected socket")
    t.add_argument("--virtio", metavar="NAME", nargs="?", const=VIRTIO_PORT_NAME, help="serve a virtio-serial port")
    ap.add_argument("--workdir", default=os.environ.get("MOORAGE_WORKDIR", "/work"))
    ap.add_argument("--extension", action="append", default=[], metavar="MODULE")
    ap.add_argument("--zygote-fd", type=int, metavar="N",
                    help="stay as the parent that forks each supervisor on the host's word on this inherited socket")
    args = ap.parse_args(argv)

    # The agent runtime (guest/agent.py), the app relay and the egress relay (its network, when the agent has
    # one) are part of every guest.
    extensions = ["agent", "app_relay", "egress_relay", "packages"] + list(args.extension) + [e for e in os.environ.get("MOORAGE_GUEST_EXTENSIONS", "").split(",") if e]
    extensions = list(dict.fromkeys(extensions))
    if args.zygote_fd is not None:
        zygote(args.zygote_fd, [e for e in extensions if "." not in e])
    elif args.virtio is not None:
        # A VM's supervisor is forked from a holder, which forks the next one on ``sys.restart`` (guest/restart.py).
        preload([e for e in extensions if "." not in e])
        restart.hold()
    workdir = args.workdir if os.path.isdir(args.workdir) else os.getcwd()

    async def run() -> None:
        sup = Supervisor(workdir, extensions)
        if args.virtio is not None:
            sup.after_oom_kill = oom_killed_since_last_start()
        if args.listen:
            await sup.run_unix(args.listen)
        elif args.fd is not None:
            await sup.run_fd(args.fd)
        else:
            await sup.run_virtio(args.virtio)

    children.install()  # after any fork above: each supervisor process installs its own
    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass
    log("supervisor exiting")
