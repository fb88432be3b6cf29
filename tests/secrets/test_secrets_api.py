"""The secrets routes: scope, validation, and no crossing of tenants (both store backends).

Another tenant — with its own agent of the same name, forged headers, or the victim's exact paths — can
neither read, change nor remove the victim's secrets; no response ever holds a value.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from moorage.store import Store
from tests.api.conftest import LiveServer, acme, globex, live  # noqa: F401  (fixtures)

VALUE = f"victim-secret-{uuid.uuid4().hex}"


def _deploy_store_only(store: Store, secret: str, agent: str) -> None:
    ts = store.tenant(store.authenticate(secret))
    ts.agents.create(agent)


def test_secret_routes_stay_inside_the_tenant(live: LiveServer, store: Store, acme: str, globex: str) -> None:
    _deploy_store_only(store, globex, "gh")
    _deploy_store_only(store, acme, "gh")  # the attacker has an agent of the same name
    with live.client(globex) as victim:
        assert victim.put("/v1/agents/gh/secrets/TOKEN", json={"value": VALUE}).status_code == 200
        assert victim.put("/v1/agents/gh/users/ada/secrets/TOKEN", json={"value": VALUE + "-ada"}).status_code == 200
    texts = []
    forged = {"X-Tenant-Id": "globex", "X-Moorage-Tenant": "globex"}
    with live.client(acme, **forged) as attacker:
        for method, path, body in [
            ("GET", "/v1/agents/gh/secrets", None),
            ("GET", "/v1/agents/gh/users/ada/secrets", None),
            ("PUT", "/v1/agents/gh/secrets/TOKEN", {"value": "attacker"}),
            ("DELETE", "/v1/agents/gh/users/ada/secrets/TOKEN", None),
        ]:
            r = attacker.request(method, path, json=body)
            texts.append(r.text)
            assert r.status_code in (200, 404), (method, path, r.status_code)
        # The attacker only ever touched its own agent "gh": its listing shows what it set, nothing of the victim.
        assert [s["name"] for s in attacker.get("/v1/agents/gh/secrets").json()["data"]] == ["TOKEN"]
        assert attacker.get("/v1/agents/gh/users/ada/secrets").status_code == 404  # no user ada in its tenant
        r = attacker.get("/v1/agents/victim-only/secrets")
        assert r.status_code == 404
    with live.client() as nobody:
        assert nobody.get("/v1/agents/gh/secrets").status_code == 401
        assert nobody.put("/v1/agents/gh/secrets/TOKEN", json={"value": "x"}).status_code == 401
    with live.client(globex) as victim:
        listed = victim.get("/v1/agents/gh/secrets").json()["data"]
        assert [(s["name"], s["version"]) for s in listed] == [("TOKEN", 1)]
        assert [s["name"] for s in victim.get("/v1/agents/gh/users/ada/secrets").json()["data"]] == ["TOKEN"]
        texts += [victim.get("/v1/agents/gh/secrets").text, victim.get("/v1/agents/gh/users/ada/secrets").text]
    assert not any(VALUE in t for t in texts)
    ts = store.tenant(store.authenticate(globex))
    from moorage.config import Config
    from moorage.secrets import SecretStore

    assert SecretStore.from_config(Config(data_dir=live.data_dir)).reveal(ts, "gh", "TOKEN", "ada") == VALUE + "-ada"


def test_secret_routes_need_the_secrets_scope_and_valid_input(live: LiveServer, store: Store, acme: str) -> None:
    _deploy_store_only(store, acme, "gh")
    store.tenant(store.authenticate(acme)).agent_users.put("gh", "ada")  # its token's user (users = "existing")
    with live.client(acme) as admin:
        invoke_key = admin.post("/v1/keys", json={"scopes": ["invoke", "deploy", "read"]}).json()["secret"]
        secrets_key = admin.post("/v1/keys", json={"scopes": ["secrets"]}).json()["secret"]
        token = admin.post("/v1/agents/gh/users/ada/tokens", json={}).json()["token"]
        assert admin.put("/v1/agents/gh/secrets/lower-case", json={"value": "x"}).status_code == 422
        assert admin.put("/v1/agents/gh/secrets/TOKEN", json={}).status_code == 422
        assert admin.put("/v1/agents/gh/secrets/TOKEN", json={"value": "two\nlines"}).status_code == 422
        assert admin.delete("/v1/agents/gh/secrets/NEVER_SET").status_code == 404
    with live.client(invoke_key) as invoker:
        assert invoker.get("/v1/agents/gh/secrets").status_code == 403
        assert invoker.put("/v1/agents/gh/secrets/TOKEN", json={"value": "x"}).status_code == 403
    with live.client(secrets_key) as manager:
        assert manager.put("/v1/agents/gh/secrets/TOKEN", json={"value": "x"}).json()["version"] == 1
        assert [x["name"] for x in manager.get("/v1/agents/gh/secrets").json()["data"]] == ["TOKEN"]
    with live.client(token) as end_user:
        assert end_user.get("/v1/agents/gh/users/ada/secrets").status_code == 403
        assert end_user.put("/v1/agents/gh/users/ada/secrets/TOKEN", json={"value": "x"}).status_code == 403


def test_the_cli_sets_lists_and_removes_without_echoing_values(live: LiveServer, store: Store, acme: str,
                                                                tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from moorage.cli.main import app

    _deploy_store_only(store, acme, "gh")
    env = {"MOORAGE_API_URL": live.url, "MOORAGE_API_KEY": acme, "MOORAGE_DATA_DIR": str(tmp_path / "cli")}
    runner = CliRunner()
    r = runner.invoke(app, ["secrets", "set", "gh", "GITHUB_TOKEN"], input=VALUE + "\n", env=env)
    assert r.exit_code == 0 and "version 1" in r.output and VALUE not in r.output, r.output
    r = runner.invoke(app, ["secrets", "list", "gh", "--json"], env=env)
    assert r.exit_code == 0 and '"GITHUB_TOKEN"' in r.output and VALUE not in r.output
    r = runner.invoke(app, ["secrets", "rm", "gh", "GITHUB_TOKEN"], env=env)
    assert r.exit_code == 0
    r = runner.invoke(app, ["secrets", "rm", "gh", "GITHUB_TOKEN"], env=env)
    assert r.exit_code == 2 and "no secret" in r.output
    ts = store.tenant(store.authenticate(acme))
    assert ts.secrets.list("gh") == []
