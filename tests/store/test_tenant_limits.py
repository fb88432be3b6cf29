"""The operator's limits of each tenant (control migration 4), on both backends: set, read, cleared, refused when
malformed, and kept apart per tenant."""

from __future__ import annotations

import pytest

from moorage.errors import InvalidInput, NotFound
from moorage.store import Store


def test_a_tenants_own_storage_ceiling_is_set_read_and_cleared(store: Store) -> None:
    acme, _ = store.operator.create_tenant("acme")
    globex, _ = store.operator.create_tenant("globex")
    assert store.operator.tenant_limits("acme") == {}  # the installation's defaults
    assert store.operator.set_tenant_limits("acme", storage_mib=512) == {"storage_mib": 512.0}
    assert store.operator.set_tenant_limits(globex.id, storage_mib=0) == {"storage_mib": 0.0}  # by id; 0: none
    assert store.backend.tenant_limits(acme.id) == {"storage_mib": 512.0}
    assert store.operator.tenant_limits("globex") == {"storage_mib": 0.0}
    assert store.operator.set_tenant_limits("acme", storage_mib=None) == {}  # back to the default
    assert store.operator.tenant_limits("acme") == {} and store.operator.tenant_limits("globex") == {"storage_mib": 0.0}
    for bad in (-1, float("inf"), float("nan"), True, "5"):
        with pytest.raises(InvalidInput):
            store.operator.set_tenant_limits("acme", storage_mib=bad)  # type: ignore[arg-type]
    with pytest.raises(NotFound):
        store.operator.set_tenant_limits("initech", storage_mib=1)
    assert [t.name for t in store.operator.list_tenants()] == ["acme", "globex"]  # reads unchanged by the column
