"""The ``exec`` method: run a process in its own process group, stream its output, enforce its timeout.

A timeout or a ``$cancel`` kills the whole process group, so children started by the command die with it.
"""

from __future__ import annotations

import asyncio
import base64
import os
import signal
from typing import Any, Dict, Optional

from .rpc import Context, Registry, RpcError, INVALID_PARAMS

_CHUNK = 64 * 1024
#: After the command exits, how long to keep reading pipes that a backgrounded child still holds open.
_DRAIN_AFTER_EXIT_S = 1.0


class _Protocol(asyncio.subprocess.SubprocessStreamProtocol):
    """Also says when the process exited: Python 3.11's ``Process.wait()`` returns only once the process's pipes
    are closed too, so a command that left a child in the background holding its output waited for that child (to
    its timeout, reported as timed out, the child killed)."""

    def __init__(self, limit: int, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit=limit, loop=loop)
        self.exited = asyncio.Event()

    def process_exited(self) -> None:
        super().process_exited()
        self.exited.set()


class ExecService:
    def __init__(self, base_env: Dict[str, str], workdir: str) -> None:
        self.base_env = dict(base_env)
        self.workdir = workdir

    async def exec(self, params: Any, ctx: Context) -> Dict[str, Any]:
        argv = params.get("argv")
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            raise RpcError("argv must be a non-empty list of strings", INVALID_PARAMS)
        timeout = params.get("timeout")
        if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
            raise RpcError("timeout must be a positive number of seconds", INVALID_PARAMS)
        env = dict(self.base_env)
        extra = params.get("env") or {}
        if not isinstance(extra, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in extra.items()):
            raise RpcError("env must map strings to strings", INVALID_PARAMS)
        env.update(extra)
        cwd = params.get("cwd") or self.workdir
        if not isinstance(cwd, str):
            raise RpcError("cwd must be a path", INVALID_PARAMS)
        cwd = os.path.join(self.workdir, cwd)  # a relative cwd is in the workdir, as the files API's paths are
        if not os.path.isdir(cwd):
            raise RpcError("cwd %s is not a directory" % cwd, INVALID_PARAMS)
        stdin_data: Optional[bytes] = base64.b64decode(params["stdin"]) if params.get("stdin") is not None else None

        loop = asyncio.get_running_loop()
        try:
            transport, protocol = await loop.subprocess_exec(
                lambda: _Protocol(_CHUNK, loop),
                *argv,
                stdin=asyncio.subprocess.PIPE if stdin_data is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=cwd,
                env=env,
                start_new_session=True,  # own process group: a kill reaches every child
            )
        except FileNotFoundError as e:
            # Same convention as a shell: 127 for "command not found", reported as a normal result.
            await ctx.emit("stderr", base64.b64encode(("exec: %s: %s\n" % (argv[0], e.strerror)).encode()).decode())
            return {"exit_code": 127, "timed_out": False}
        except PermissionError as e:
            await ctx.emit("stderr", base64.b64encode(("exec: %s: %s\n" % (argv[0], e.strerror)).encode()).decode())
            return {"exit_code": 126, "timed_out": False}

        proc = asyncio.subprocess.Process(transport, protocol, loop)

        async def pump(stream: asyncio.StreamReader, name: str) -> None:
            while True:
                chunk = await stream.read(_CHUNK)
                if not chunk:
                    return
                await ctx.emit(name, base64.b64encode(chunk).decode())

        async def feed() -> None:
            assert proc.stdin is not None
            try:
                proc.stdin.write(stdin_data or b"")
                await proc.stdin.drain()
            except (BrokenPipeError, ConnectionResetError):
                pass
            finally:
                proc.stdin.close()

        assert proc.stdout is not None and proc.stderr is not None
        pumps = [asyncio.ensure_future(pump(proc.stdout, "stdout")), asyncio.ensure_future(pump(proc.stderr, "stderr"))]
        feeder = asyncio.ensure_future(feed()) if stdin_data is not None else None
        timed_out = False
        try:
            try:
                async with asyncio.timeout(timeout):  # not wait_for: 3.11's drops a cancel that comes with the exit
                    await protocol.exited.wait()
            except asyncio.TimeoutError:
                timed_out = True
                _kill_group(proc.pid)
                await protocol.exited.wait()
            # Output already written must reach the host; a background child holding the pipe must not hang us.
            done, pending = await asyncio.wait(pumps, timeout=_DRAIN_AFTER_EXIT_S)
            for p in pending:
                p.cancel()
        except asyncio.CancelledError:
            _kill_group(proc.pid)
            for p in pumps:
                p.cancel()
            raise
        finally:
            if feeder is not None:
                feeder.cancel()
            transport.close()  # the pipes a background child still holds: nobody reads them any more
        return {"exit_code": proc.returncode, "timed_out": timed_out}


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def register(registry: Registry, base_env: Dict[str, str], workdir: str) -> None:
    svc = ExecService(base_env, workdir)
    registry.add("exec", svc.exec)
