"""HTTPS: ``ctx.fetch``'s client connects to the judged loopback address yet checks the certificate against
the admitted name; a CONNECT tunnel carries the client's own TLS end to end (the gateway never terminates it).
The certificates are made here for names the test resolver maps into 127.0.0.0/8."""

from __future__ import annotations

import asyncio
import datetime
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from moorage.egress import Egress, EgressFailed, Gateway, StaticResolver, fetch
from tests.egress.conftest import TEST_OPERATOR


def _cert(tmp: Path, name: str) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for ``name`` signed by it: (ca.pem, cert.pem, key.pem)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "moorage test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = (tmp / "ca.pem", tmp / "cert.pem", tmp / "key.pem")
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


class _Hello(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a: Any) -> None:
        pass

    def do_GET(self) -> None:
        body = f"tls {self.path}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def tls_upstream(tmp_path: Path) -> Iterator[tuple[int, ssl.SSLContext]]:
    ca, cert, key = _cert(tmp_path, "secure.test")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    server.daemon_threads = True
    sctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    sctx.load_cert_chain(cert, key)
    server.socket = sctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    client = ssl.create_default_context(cafile=str(ca))
    yield server.server_address[1], client
    server.shutdown()
    server.server_close()


def _egress() -> Egress:
    return Egress(TEST_OPERATOR, StaticResolver({"secure.test": ["127.0.0.1"], "impostor.test": ["127.0.0.1"]}))


async def test_fetch_verifies_the_admitted_name_on_the_judged_address(tls_upstream) -> None:  # type: ignore[no-untyped-def]
    port, client = tls_upstream
    eg = _egress()
    inst = eg.instance({"egress": {"allow": [f"https://secure.test:{port}", f"https://impostor.test:{port}"]}})
    r = await fetch(inst, "GET", f"https://secure.test:{port}/x", tls=client)
    assert r.status == 200 and r.body == b"tls /x"
    # Same address, another name: the certificate does not cover it, and the guest hears a generic failure.
    with pytest.raises(EgressFailed) as e:
        await fetch(inst, "GET", f"https://impostor.test:{port}/x", tls=client)
    assert "certificate" not in str(e.value).lower()


async def test_a_connect_tunnel_carries_the_clients_own_tls(tls_upstream) -> None:  # type: ignore[no-untyped-def]
    port, client = tls_upstream
    eg = _egress()
    g = Gateway(eg)
    b = await g.bind("i1", eg.instance({"egress": {"allow": [f"https://secure.test:{port}"]}}), dns=False)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", b.proxy_port)
        writer.write(f"CONNECT secure.test:{port} HTTP/1.1\r\n\r\n".encode())
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        await writer.start_tls(client, server_hostname="secure.test")  # the upstream's certificate, end to end
        writer.write(b"GET /tunnelled HTTP/1.1\r\nHost: secure.test\r\nConnection: close\r\n\r\n")
        assert (await asyncio.wait_for(reader.read(), 10)).endswith(b"tls /tunnelled")
        writer.close()
    finally:
        await g.close()
