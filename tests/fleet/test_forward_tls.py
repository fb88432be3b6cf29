"""A host registered at an ``https`` host_url behind TLS with a private CA: another host forwards turns and app
WebSockets to it when its own ``SSL_CERT_FILE`` names that CA (as the CLI and the SDK trust one), and refuses to
when it does not (the certificate is checked, not waved through), saying why in its log."""

from __future__ import annotations

import asyncio
from typing import Iterator

import pytest
from websockets.asyncio.client import connect

from tests.app.wsapp import agent_py
from tests.fleet.harness import Fleet
from tests.tls import TlsFront, certificate

pytestmark = pytest.mark.timeout(600)

AGENT = agent_py(r'''
class Handler(AppHandler):
    def respond(self):
        self.switch()
        self.echo_text()


serve(Handler)


async def on_message(ctx, message):
    return "ok: " + message
''')


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, pg_cluster, seaweedfs,  # noqa: ANN001
          s3_bucket) -> Iterator[tuple[Fleet, TlsFront]]:  # noqa: ANN001
    base = tmp_path_factory.mktemp("forward-tls")
    cert, key = certificate(base)
    front = TlsFront(cert, key)
    env = {"SSL_CERT_FILE": str(cert)}  # h1 trusts the private CA
    f = Fleet(base, pg_cluster.create_database("forward_tls"), seaweedfs.settings(s3_bucket, f"fleet-{base.name}"),
              n=0)
    try:
        f.add_host(environ=env)
        f.add_host(host_url=front.url)  # h2: behind TLS, its host_url the front's
        front.target = f.hosts[1].port
        f.add_host(environ={"SSL_CERT_FILE": ""})  # h3: the CA not named
        f.deploy_agent("tls", AGENT, "ports = [8080]\n")
        r = f.api[1].post("/v1/agents/tls/invoke", json={"message": "wake", "user": "ada"})
        assert r.status_code == 200 and f.records()["ada"].host == "h2", r.text
        yield f, front
    finally:
        f.close()
        front.close()


def test_a_host_behind_tls_with_a_private_ca_is_forwarded_to(fleet: tuple[Fleet, TlsFront]) -> None:
    f, front = fleet
    before = front.handshakes
    r = f.api[0].post("/v1/agents/tls/invoke", json={"message": "through tls", "user": "ada"})
    assert r.status_code == 200 and r.json()["reply"] == "ok: through tls", r.text
    assert r.headers["x-moorage-served-by"] == "h2"
    assert front.handshakes > before  # through the front, over TLS

    async def echo() -> str:
        async with connect(f"ws://127.0.0.1:{f.hosts[0].port}/v1/agents/tls/users/ada/app/ws",
                           additional_headers={"Authorization": f"Bearer {f.key}"}, open_timeout=60) as ws:
            await ws.send("socket")
            return str(await asyncio.wait_for(ws.recv(), 30))

    before = front.handshakes
    assert asyncio.run(echo()) == "echo: socket"
    assert front.handshakes > before


def test_a_host_that_does_not_trust_the_ca_does_not_forward(fleet: tuple[Fleet, TlsFront]) -> None:
    f, _ = fleet
    r = f.api[2].post("/v1/agents/tls/invoke", json={"message": "unverified", "user": "ada"})
    assert r.status_code == 503 and "host 'h2'" in r.json()["detail"], r.text
    assert f.records()["ada"].host == "h2"  # nothing moved
    # The operator reads why in the host's log.
    assert "certificate is not trusted here" in f.hosts[2].log.read_text() and "CERTIFICATE_VERIFY_FAILED" in \
        f.hosts[2].log.read_text()

    async def refused() -> int:
        try:
            async with connect(f"ws://127.0.0.1:{f.hosts[2].port}/v1/agents/tls/users/ada/app/ws",
                               additional_headers={"Authorization": f"Bearer {f.key}"}, open_timeout=60):
                return 101
        except Exception as e:  # noqa: BLE001 - the refusal's status is what is checked
            return getattr(getattr(e, "response", None), "status_code", 0)

    assert asyncio.run(refused()) == 503
