"""TLS for tests: a certificate for 127.0.0.1 from a CA only the test trusts (as a private one would be), and a TLS
front (terminates TLS, relays the bytes to a plain port, as a proxy in front of a host does)."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import subprocess
import threading
from pathlib import Path


def certificate(where: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (its own CA) and its key."""
    cert, key = where / "cert.pem", where / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True, timeout=60)
    return cert, key


class TlsFront:
    """``https://127.0.0.1:<port>`` in front of ``127.0.0.1:<target>``: each connection's bytes relayed both ways
    once its TLS handshake is done (HTTP and WebSocket alike). ``target`` may be set after it listens (a host whose
    URL must name this front before the host has a port)."""

    def __init__(self, cert: Path, key: Path, target: int = 0) -> None:
        self.target = target
        self.handshakes = 0
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(str(cert), str(key))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="tls-front")
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._relay, "127.0.0.1", 0, ssl=ctx), self._loop).result(30)
        self.port = self._server.sockets[0].getsockname()[1]
        self.url = f"https://127.0.0.1:{self.port}"

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.handshakes += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.close()
            return

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (OSError, ssl.SSLError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
