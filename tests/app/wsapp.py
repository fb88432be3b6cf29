"""The test agents' app server: plain HTTP and WebSocket on the app's port with the standard library only (the
sandbox's Python has nothing else). This file's own source goes into the sandbox ahead of each agent's code
(``agent_py``): an agent subclasses ``AppHandler`` with its ``respond`` and calls ``serve``.
"""

import base64
import hashlib
import socketserver
import struct
import threading

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


class AppHandler(socketserver.StreamRequestHandler):
    """One connection: its request head is read into ``method``, ``target`` and ``headers`` (names in lower case),
    then ``respond`` answers it (plain HTTP itself, or ``switch`` and frames for a WebSocket)."""

    def handle(self):
        line = self.rfile.readline(65537).decode("latin-1")
        if not line:
            return
        self.method, self.target, _ = line.split(" ", 2)
        self.headers = {}
        while True:
            h = self.rfile.readline(65537).decode("latin-1")
            if h in ("\r\n", "\n", ""):
                break
            k, _, v = h.partition(":")
            self.headers[k.strip().lower()] = v.strip()
        self.respond()

    def respond(self):
        raise NotImplementedError

    def upgrade(self):
        """Whether the request asks for a WebSocket."""
        return self.headers.get("upgrade", "").lower() == "websocket"

    def offered(self):
        """The subprotocols the client offers."""
        return [p.strip() for p in self.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]

    def switch(self, extra=b""):
        """Accept the WebSocket: a 101 with ``extra`` header lines (each ending with CRLF)."""
        accept = base64.b64encode(hashlib.sha1(self.headers["sec-websocket-key"].encode() + GUID).digest())
        self.wfile.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                         b"Sec-WebSocket-Accept: " + accept + b"\r\n" + extra + b"\r\n")
        self.wfile.flush()

    def frame(self, opcode, data, fin=True):
        n, b0 = len(data), (0x80 if fin else 0) | opcode
        if n < 126:
            head = struct.pack("!BB", b0, n)
        elif n < 65536:
            head = struct.pack("!BBH", b0, 126, n)
        else:
            head = struct.pack("!BBQ", b0, 127, n)
        self.wfile.write(head + data)
        self.wfile.flush()

    def echo_text(self):
        """Answer each text message with ``echo: `` and the message, until the caller closes."""
        while True:
            opcode, data = self.read_frame()
            if opcode is None or opcode == 8:
                return
            if opcode == 1:
                self.frame(1, b"echo: " + data)

    def read_frame(self):
        """(opcode, unmasked payload) of the client's next frame; (None, b"") once it closed the connection."""
        head = self.rfile.read(2)
        if len(head) < 2:
            return None, b""
        opcode, n = head[0] & 0x0F, head[1] & 0x7F
        if n == 126:
            n = struct.unpack("!H", self.rfile.read(2))[0]
        elif n == 127:
            n = struct.unpack("!Q", self.rfile.read(8))[0]
        mask = self.rfile.read(4) if head[1] & 0x80 else b"\0\0\0\0"
        data = bytearray(self.rfile.read(n))
        for i in range(len(data)):
            data[i] ^= mask[i % 4]
        return opcode, bytes(data)


class AppServer(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True


def serve(handler, port=8080):
    """Serve ``handler`` on 127.0.0.1:``port`` in a thread (the agent module's load starts it)."""

    def run():
        try:
            AppServer(("127.0.0.1", port), handler).serve_forever()
        except OSError:
            pass  # loaded again in the same sandbox: the first server keeps serving

    threading.Thread(target=run, daemon=True).start()


def agent_py(code):
    """An agent module for the sandbox: this file's source, then ``code`` (dedented), which uses it."""
    import textwrap
    from pathlib import Path

    return Path(__file__).read_text() + "\n\n# -- the agent's own --\n" + textwrap.dedent(code)
