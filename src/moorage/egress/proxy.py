"""The gateway's HTTP(S) forward proxy: CONNECT tunnels for TLS (never intercepted), absolute-form plain HTTP.

One client connection carries one request: the target is decided before anything is connected, plain
HTTP gets the agent's bound secret headers and ``Connection: close``, and every attempt is one span.
"""

from __future__ import annotations

import asyncio
import contextlib
from moorage.aio import within
from moorage.egress.connector import EgressFailed, InstanceEgress
from moorage.egress.limits import EgressLimited
from moorage.egress.rules import EgressDenied, Target, normalize_host
from moorage.log import get_logger
from moorage.errors import MoorageError

log = get_logger(__name__)

HEAD_LIMIT = 64 * 1024
HEAD_TIMEOUT_S = 30.0
IDLE_TIMEOUT_S = 300.0
CHUNK = 256 * 1024
_HOP = {b"connection", b"keep-alive", b"proxy-authorization", b"proxy-connection", b"proxy-authenticate", b"te",
        b"trailer", b"upgrade", b"host", b"expect"}


class BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def _reply(writer: asyncio.StreamWriter, status: int, reason: str, text: str = "") -> None:
    body = (text + "\n").encode() if text else b""
    writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain; charset=utf-8\r\n"
                 f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    with contextlib.suppress(Exception):
        await writer.drain()


async def _read_head(reader: asyncio.StreamReader) -> tuple[bytes, bytes, bytes, list[tuple[bytes, bytes]]]:
    try:
        raw = await within(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
    except asyncio.LimitOverrunError:
        raise BadRequest(431, "request head too large") from None
    except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError):
        raise BadRequest(400, "incomplete request") from None
    lines = raw[:-4].split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        raise BadRequest(400, "malformed request line")
    headers: list[tuple[bytes, bytes]] = []
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip() or line[:1] in (b" ", b"\t"):
            raise BadRequest(400, "malformed header")
        headers.append((name, value.strip()))
    return parts[0], parts[1], parts[2], headers


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> list[bytes]:
    return [v for k, v in headers if k.lower() == name]


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, inst: InstanceEgress,
                count: dict[str, int], key: str) -> None:
    loop = asyncio.get_running_loop()
    try:
        # One idle deadline, pushed out after every read (cheaper than a wait_for task per chunk).
        async with asyncio.timeout(IDLE_TIMEOUT_S) as idle:
            while True:
                data = await reader.read(CHUNK)
                if not data:
                    break
                idle.reschedule(loop.time() + IDLE_TIMEOUT_S)
                await inst.usage.spend(len(data))
                count[key] += len(data)
                writer.write(data)
                await writer.drain()
    finally:
        with contextlib.suppress(Exception):
            if writer.can_write_eof():
                writer.write_eof()


async def _copy_exact(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int, inst: InstanceEgress,
                      count: dict[str, int]) -> None:
    while n > 0:
        data = await within(reader.read(min(n, CHUNK)), IDLE_TIMEOUT_S)
        if not data:
            raise BadRequest(400, "request body ended early")
        await inst.usage.spend(len(data))
        count["sent"] += len(data)
        n -= len(data)
        writer.write(data)
        await writer.drain()


async def _copy_chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, inst: InstanceEgress,
                        count: dict[str, int]) -> None:
    """Pass a chunked body through as it is, reading exactly to its end (so nothing after it is forwarded)."""
    while True:
        line = await within(reader.readuntil(b"\r\n"), IDLE_TIMEOUT_S)
        writer.write(line)
        try:
            size = int(line.split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise BadRequest(400, "malformed chunked body") from None
        if size == 0:
            while True:  # trailers, then the empty line
                trailer = await within(reader.readuntil(b"\r\n"), IDLE_TIMEOUT_S)
                writer.write(trailer)
                if trailer == b"\r\n":
                    await writer.drain()
                    return
        await _copy_exact(reader, writer, size + 2, inst, count)


async def serve_connection(inst: InstanceEgress, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Serve one client connection of the proxy for the instance ``inst``."""
    try:
        try:
            method, target, version, headers = await _read_head(reader)
            if method == b"CONNECT":
                await _tunnel(inst, reader, writer, target)
            else:
                await _forward(inst, reader, writer, method, target, headers)
        except BadRequest as e:
            await _reply(writer, e.status, "Bad Request" if e.status == 400 else "Request Header Fields Too Large", str(e))
        except EgressDenied as e:
            await _reply(writer, 403, "Forbidden", str(e))
        except EgressLimited as e:
            await _reply(writer, 429, "Too Many Requests", str(e))
        except (EgressFailed, MoorageError) as e:
            await _reply(writer, 502, "Bad Gateway", str(e))
    except Exception as e:  # noqa: BLE001 - a broken client connection ends here, never the gateway
        log.info("gateway connection ended", error=type(e).__name__)
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


def _authority(target: bytes) -> tuple[str, int]:
    text = target.decode("ascii", "replace")
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536 or "@" in text or "/" in text:
        raise BadRequest(400, "CONNECT needs host:port")
    try:
        return normalize_host(host), int(port)
    except (ValueError, UnicodeError):
        raise BadRequest(400, "CONNECT names a malformed host") from None


async def _tunnel(inst: InstanceEgress, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, target: bytes) -> None:
    host, port = _authority(target)
    d = await inst.egress.check_tunnel(inst.policy, host, port, inst.owner)
    async with inst.attempt("proxy-connect", d) as info:
        up_r, up_w, address = await inst.egress.open(d)
        info["egress.address"] = address
        count = {"sent": 0, "received": 0}
        try:
            writer.write(b"HTTP/1.1 200 Connection Established\r\n\r\n")
            await writer.drain()
            # The tunnel carries TLS end to end: the host sees only how many bytes pass.
            async with asyncio.TaskGroup() as tg:  # one side failing ends the other
                tg.create_task(_pipe(reader, up_w, inst, count, "sent"))
                tg.create_task(_pipe(up_r, writer, inst, count, "received"))
        finally:
            info["egress.bytes_sent"], info["egress.bytes_received"] = count["sent"], count["received"]
            up_w.close()


async def _forward(inst: InstanceEgress, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, method: bytes,
                   target: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    text = target.decode("ascii", "replace")
    if not text.lower().startswith("http://"):
        if text.lower().startswith("https://"):
            raise BadRequest(400, "https URLs go through CONNECT (set HTTPS_PROXY)")
        raise BadRequest(400, "this is a forward proxy: send an absolute http:// URL")
    t = Target.parse(text)
    d = await inst.egress.check(inst.policy, t, inst.owner)
    async with inst.attempt("proxy-http", d, **{"http.method": method.decode("ascii", "replace")[:16],
                                                 "egress.path": t.path.split("?", 1)[0][:200]}) as info:
        lengths = _header(headers, b"content-length")
        codings = [c.strip().lower() for v in _header(headers, b"transfer-encoding") for c in v.split(b",")]
        chunked = bool(codings)
        if codings and codings[-1] != b"chunked":
            raise BadRequest(400, "a transfer-coded request body must end in chunked")
        if len(set(lengths)) > 1 or (lengths and chunked) or (lengths and not lengths[0].isdigit()):
            raise BadRequest(400, "ambiguous request body length")
        added = await inst.headers(t) if inst.headers is not None else {}
        info["egress.secrets"] = len(added)
        replaced = {k.lower().encode() for k in added}
        out = [f"{method.decode('ascii')} {t.path} HTTP/1.1\r\nHost: {t.authority}\r\n".encode()]
        for k, v in headers:
            if k.lower() in _HOP or k.lower() in replaced:
                continue
            out.append(k + b": " + v + b"\r\n")
        for k, v in added.items():
            out.append(f"{k}: {v}\r\n".encode("latin-1"))
        out.append(b"Connection: close\r\n\r\n")
        up_r, up_w, address = await inst.egress.open(d)
        info["egress.address"] = address
        count = {"sent": 0, "received": 0}
        try:
            head = b"".join(out)
            await inst.usage.spend(len(head))
            up_w.write(head)
            if (chunked or lengths) and any(v.lower() == b"100-continue" for v in _header(headers, b"expect")):
                # The body is read here, exactly to its end, so the client may send it now.
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                await writer.drain()
            if chunked:
                await _copy_chunked(reader, up_w, inst, count)
            elif lengths:
                await _copy_exact(reader, up_w, int(lengths[0]), inst, count)
            await up_w.drain()
            first = await within(up_r.read(CHUNK), IDLE_TIMEOUT_S)
            if first[:9].startswith(b"HTTP/1.") and first[9:12].isdigit():
                info["http.status_code"] = int(first[9:12])
            if first:
                await inst.usage.spend(len(first))
                count["received"] += len(first)
                writer.write(first)
                # Upstream closes after the response (we asked for Connection: close); relay to its end.
                await _pipe(up_r, writer, inst, count, "received")
        finally:
            info["egress.bytes_sent"], info["egress.bytes_received"] = count["sent"], count["received"]
            up_w.close()

