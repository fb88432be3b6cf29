"""``otlp_endpoint``: the host ``moorage up`` builds sends a copy of every API span to an OTLP/HTTP receiver
(here a real one on loopback that the test runs), and the setting is read from moorage.toml."""

from __future__ import annotations

import asyncio
import io
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import uvicorn
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from moorage.api import create_app
from moorage.config import Config, load
from moorage.runtime.host import Host
from tests.api.conftest import free_port


def archive() -> bytes:
    files = {"moorage.toml": '[agent]\nname = "echo"\nentry = "agent.py"\n[agent.lifecycle]\nusers = "auto"\n',
             "agent.py": 'async def on_message(ctx, message):\n    return "echo: " + message\n'}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    return buf.getvalue()


@pytest.fixture
def receiver() -> Iterator[tuple[str, list[tuple[str, str, bytes]]]]:
    """An OTLP/HTTP traces receiver on loopback: records (path, content type, body) of every POST."""
    got: list[tuple[str, str, bytes]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            got.append((self.path, self.headers.get("Content-Type", ""), body))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces", got
    finally:
        server.shutdown()
        server.server_close()


def exported_spans(got: list[tuple[str, str, bytes]]) -> list[tuple[dict[str, Any], Any]]:
    """Every span the receiver got, with its resource's attributes."""
    out = []
    for _, _, body in got:
        req = ExportTraceServiceRequest()
        req.ParseFromString(body)
        for rs in req.resource_spans:
            resource = {a.key: a.value.string_value for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                out.extend((resource, span) for span in ss.spans)
    return out


@pytest.mark.timeout(240)
async def test_host_exports_api_and_turn_spans_to_the_otlp_endpoint(tmp_path: Path, receiver) -> None:
    endpoint, got = receiver
    cfg = Config(data_dir=tmp_path / "data", sandbox_driver="process", otlp_endpoint=endpoint)
    host = Host.open(cfg)
    assert host.span_sink is not None and host.runtime.tracer.sink is host.span_sink
    await host.start()
    port = free_port()
    # As `moorage up` builds its app: the API's tracer exports through the host's sink.
    server = uvicorn.Server(uvicorn.Config(create_app(host.runtime, cfg, span_sink=host.span_sink),
                                           host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        tenant, key = host.store.operator.create_tenant("acme")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}",
                                     headers={"Authorization": f"Bearer {key.secret}"}, timeout=120) as c:
            r = await c.get("/v1/agents")
            assert r.status_code == 200, r.text
            r = await c.post("/v1/agents/echo/deployments", content=archive(),
                             headers={"content-type": "application/gzip"})
            assert r.status_code == 201, r.text
            r = await c.post("/v1/agents/echo/invoke", json={"message": "hi", "user": "ada"})
            assert r.status_code == 200 and r.json()["reply"] == "echo: hi", r.text
    finally:
        server.should_exit = True
        await task
        await host.close()  # flushes the exporter's queue
    assert got, "nothing reached the OTLP endpoint"
    assert all(path == "/v1/traces" and ctype == "application/x-protobuf" for path, ctype, _ in got)
    spans = exported_spans(got)
    api = [(res, s) for res, s in spans if s.name == "GET /v1/agents"]
    assert len(api) == 1, [s.name for _, s in spans]
    res, span = api[0]
    assert res["service.name"] == "moorage"
    attrs = {a.key: a.value.string_value for a in span.attributes}
    assert attrs["moorage.tenant"] == tenant.id
    assert len(span.trace_id) == 16 and len(span.span_id) == 8
    # The turn's own span (recorded by the runtime's tracer) is exported too, naming agent and user.
    turns = [s for _, s in spans if s.name == "turn"]
    assert len(turns) == 1, [s.name for _, s in spans]
    turn_attrs = {a.key: a.value.string_value for a in turns[0].attributes}
    assert turn_attrs["agent"] == "echo" and turn_attrs["user"] == "ada"
    assert turn_attrs["moorage.tenant"] == tenant.id


def test_otlp_endpoint_is_read_from_moorage_toml(tmp_path: Path) -> None:
    path = tmp_path / "moorage.toml"
    path.write_text('[moorage]\notlp_endpoint = "http://127.0.0.1:4318/v1/traces"\n')
    assert load(path, env={}).otlp_endpoint == "http://127.0.0.1:4318/v1/traces"
    assert load(path, env={"MOORAGE_OTLP_ENDPOINT": "http://127.0.0.1:9/v1/traces"}).otlp_endpoint == \
        "http://127.0.0.1:9/v1/traces"
    assert Config().otlp_endpoint == ""


def test_no_endpoint_no_sink(tmp_path: Path) -> None:
    host = Host.open(Config(data_dir=tmp_path / "data", sandbox_driver="process"))
    try:
        assert host.span_sink is None and host.runtime.tracer.sink is None
    finally:
        asyncio.run(host.close())
