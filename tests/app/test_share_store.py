"""Share links in the store, on both backends: created, listed per user, revoked once, forgotten with the user,
and never visible to another tenant; tokens are refused when altered, expired, revoked or of another tenant."""

from __future__ import annotations

import time

import pytest

from moorage.config import Config
from moorage.errors import InvalidInput, NotFound
from moorage.runtime.share_links import ShareLinkNotFound, ShareSigner
from moorage.store import Store


def test_links_are_per_tenant_and_revocable(store: Store, tmp_path) -> None:
    acme = store.tenant(store.authenticate(store.operator.create_tenant("acme")[1].secret))
    globex = store.tenant(store.authenticate(store.operator.create_tenant("globex")[1].secret))
    link = acme.share_links.create("web", "ada", 60, "review")
    other = acme.share_links.create("web", "bob", 60)
    assert [x.id for x in acme.share_links.list("web", "ada")] == [link.id]
    assert {x.id for x in acme.share_links.list("web")} == {link.id, other.id}
    assert globex.share_links.list("web") == []
    with pytest.raises(NotFound):
        globex.share_links.get(link.id)
    with pytest.raises(NotFound):
        globex.share_links.revoke("web", "ada", link.id)
    with pytest.raises(NotFound):  # a link is revoked under its own user only
        acme.share_links.revoke("web", "bob", link.id)
    assert acme.share_links.get(link.id).revoked_at is None
    revoked = acme.share_links.revoke("web", "ada", link.id)
    assert revoked.revoked_at is not None and not revoked.usable(time.time())
    for ttl in (0, -1, 10**9, True, "1h"):
        with pytest.raises(InvalidInput):
            acme.share_links.create("web", "ada", ttl)  # type: ignore[arg-type]
    acme.forget_user("bob", "web")
    with pytest.raises(NotFound):
        acme.share_links.get(other.id)

    signer = ShareSigner.from_config(Config(data_dir=tmp_path / "data"))
    fresh = acme.share_links.create("web", "ada", 60)
    token = signer.token(acme.tenant_id, fresh)
    ts, opened = signer.open(store, token)
    assert (ts.tenant_id, opened.id, opened.user) == (acme.tenant_id, fresh.id, "ada")
    t, lid, exp, kid, mac = token.split(".")
    for bad in (token.replace(acme.tenant_id, globex.tenant_id), f"{t}.{revoked.id}.{exp}.{kid}.{mac}",
                f"{t}.{lid}.{int(exp) + 1}.{kid}.{mac}", token[:-1] + ("A" if token[-1] != "A" else "B"), ""):
        with pytest.raises(ShareLinkNotFound):
            signer.open(store, bad)
    with pytest.raises(ShareLinkNotFound):  # past its expiry
        signer.open(store, token, now=fresh.expires_at + 1)
    # Another host's key (another operator) does not open it.
    with pytest.raises(ShareLinkNotFound):
        ShareSigner.from_config(Config(data_dir=tmp_path / "other")).open(store, token)
    acme.share_links.revoke("web", "ada", fresh.id)
    with pytest.raises(ShareLinkNotFound):
        signer.open(store, token)
