"""Deploy-time checks of [agent.egress], [agent.network] and [agent.secrets]: a bad table fails the deploy
with what to fix; the documented forms (including the old prefix lists) still deploy."""

from __future__ import annotations

import pytest

from moorage.runtime.package import AgentPackageError, validate_files
from moorage.secrets import Bindings

BASE = '[agent]\nname = "a"\nsystem_prompt = "x"\n'


@pytest.mark.parametrize("tables", [
    '[agent.egress]\nallow = ["https://api.github.com", "http://127.0.0.1:", "https://*.example.com:8443/v1/"]\n',
    '[agent.network]\nallow = ["pypi.org"]\npackages = true\n',
    '[agent.secrets]\nenv = ["OPENAI_API_KEY"]\nGITHUB_TOKEN = { header = "Authorization", format = "Bearer {}", '
    'hosts = ["api.github.com", "*.githubusercontent.com", "localhost:8080"] }\n',
])
def test_documented_forms_deploy(tables: str) -> None:
    assert validate_files({"moorage.toml": (BASE + tables).encode()}).name == "a"


@pytest.mark.parametrize("tables,says", [
    ('[agent.egress]\nallow = ["http://"]\n', "names no host"),
    ('[agent.egress]\nallow = ["https://user@a.test"]\n', "user name"),
    ('[agent.secrets]\nT = { header = "Authorization" }\n', "hosts must list"),
    ('[agent.secrets]\nT = { header = "Host", hosts = ["a.test"] }\n', "not a header"),
    ('[agent.secrets]\nT = { format = "Bearer", hosts = ["a.test"] }\n', "exactly once"),
    ('[agent.secrets]\nT = { hosts = ["https://a.test/x"] }\n', "host names"),
    ('[agent.secrets]\nlower = { hosts = ["a.test"] }\n', "not a secret name"),
])
def test_bad_tables_fail_the_deploy_with_what_to_fix(tables: str, says: str) -> None:
    with pytest.raises(AgentPackageError, match=says):
        validate_files({"moorage.toml": (BASE + tables).encode()})


def test_bindings_match_hosts_and_ports() -> None:
    b = Bindings.from_manifest({"secrets": {"T": {"hosts": ["api.test", "*.wild.test", "local.test:8080"]}}})
    assert [x.name for x in b.for_host("api.test", 443)] == ["T"]
    assert b.for_host("a.wild.test", 443) and not b.for_host("wild.test", 443)
    assert b.for_host("local.test", 8080) and not b.for_host("local.test", 8081)
    assert not b.for_host("api.test.evil.test", 443)
    assert b.headers[0].render("v") == "v" and b.headers[0].header == "Authorization"
