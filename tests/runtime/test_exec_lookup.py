"""``get_exec``: an exec id that does not exist, another agent's exec (to a key limited to one agent), another
tenant's and a turn the caller may not see are one 404 with one wording, so its message never tells that the id
exists; a turn the caller may see is a 409 saying how a turn is cancelled, and the caller's own exec is returned."""

from __future__ import annotations

from dataclasses import replace

import pytest

from moorage.errors import ConflictError, NotFound
from moorage.runtime import exec_jobs
from moorage.store import Store, TenantStore
from tests.conftest import system_principal

EXEC = {"kind": exec_jobs.KIND, "sandbox_id": "sb-1", "argv": ["true"], "timeout_s": 5.0}


def _not_found(ts: TenantStore, principal, execution_id: str) -> tuple[str, str | None]:  # type: ignore[no-untyped-def]
    with pytest.raises(NotFound) as e:
        exec_jobs.get_exec(ts, principal, execution_id)
    return e.value.message, e.value.hint


def test_one_wording_for_every_exec_id_the_caller_may_not_follow(store: Store, tenant: TenantStore,
                                                                 other_tenant: TenantStore) -> None:
    tenant.executions.create("ex-web", "web", "ada", "", EXEC)
    tenant.executions.create("ex-turn", "web", "ada", "s1", {"message": "hi"})
    other_tenant.executions.create("ex-theirs", "web", "ada", "", EXEC)
    admin = system_principal(store, tenant.tenant_id)
    mail_key = replace(admin, agent="mail")  # a key limited to another agent
    end_user = replace(admin, agent="web", user="ada")  # an end-user token never follows execs

    assert exec_jobs.get_exec(tenant, admin, "ex-web").id == "ex-web"
    with pytest.raises(ConflictError, match="is a turn, not an exec"):
        exec_jobs.get_exec(tenant, admin, "ex-turn")

    hint = "exec execution ids come from POST /v1/sandboxes/{id}/exec with detach: true"
    for principal, execution_id in ((admin, "ex-missing"), (admin, "ex-theirs"), (mail_key, "ex-web"),
                                    (mail_key, "ex-turn"), (mail_key, "ex-missing"), (end_user, "ex-web"),
                                    (end_user, "ex-missing")):
        assert _not_found(tenant, principal, execution_id) == (f"no exec execution {execution_id!r}", hint), \
            (principal, execution_id)
