"""API keys: shown once, stored as a hash, scoped, bound to the node ids they upload for,
revocable."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from sqlalchemy.orm import Session

from service.store.keys import (
    KeyScope,
    allows,
    authenticate,
    create_key,
    hash_token,
    list_keys,
    revoke_key,
    speaks_for,
)

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def test_a_new_key_is_stored_only_as_its_hash(session: Session) -> None:
    issued = create_key(session, scopes=[KeyScope.UPLOAD], name="fleet", now=NOW, nodes=["n1"])
    token = issued.token
    assert token.startswith(f"vck_{issued.key.prefix}_")
    assert len(token) > 40
    assert issued.key.key_hash == hash_token(token) != token
    assert token not in (issued.key.prefix, issued.key.name, issued.key.key_hash)
    assert issued.key.scopes == ["upload"]


def test_authenticates_its_own_token_only(session: Session) -> None:
    issued = create_key(session, scopes=[KeyScope.READ], name="reader", now=NOW)
    other = create_key(session, scopes=[KeyScope.READ], name="other", now=NOW)
    assert authenticate(session, issued.token) is issued.key
    assert authenticate(session, other.token) is other.key
    assert authenticate(session, issued.token[:-1]) is None
    assert authenticate(session, "Bearer " + issued.token) is None
    assert authenticate(session, "") is None


def test_a_revoked_key_no_longer_authenticates(session: Session) -> None:
    issued = create_key(session, scopes=[KeyScope.UPLOAD], name="fleet", now=NOW, nodes=["*"])
    assert revoke_key(session, issued.key.prefix, now=NOW) is issued.key
    assert authenticate(session, issued.token) is None
    assert revoke_key(session, issued.key.prefix, now=NOW) is issued.key
    assert revoke_key(session, "00000000", now=NOW) is None
    assert list_keys(session) == []
    assert list_keys(session, include_revoked=True) == [issued.key]


def test_scopes_and_admin(session: Session) -> None:
    upload = create_key(session, scopes=[KeyScope.UPLOAD], name="u", now=NOW, nodes=["*"]).key
    admin = create_key(session, scopes=[KeyScope.ADMIN], name="a", now=NOW).key
    both = create_key(
        session, scopes=[KeyScope.READ, KeyScope.UPLOAD], name="b", now=NOW, nodes=["*"]
    ).key
    assert allows(upload, KeyScope.UPLOAD)
    assert not allows(upload, KeyScope.READ)
    assert not allows(upload, KeyScope.ADMIN)
    assert all(allows(admin, scope) for scope in KeyScope)
    assert allows(both, KeyScope.READ) and allows(both, KeyScope.UPLOAD)
    assert both.scopes == ["read", "upload"]


def test_a_key_needs_a_scope(session: Session) -> None:
    with pytest.raises(ValueError, match="scope"):
        create_key(session, scopes=[], name="none", now=NOW)


def test_an_upload_key_speaks_for_the_nodes_it_was_made_for(session: Session) -> None:
    key = create_key(
        session,
        scopes=[KeyScope.UPLOAD],
        name="rack 3",
        now=NOW,
        nodes=["gpu-node-*", "login-1", "gpu-node-*"],
    ).key
    assert key.nodes == ["gpu-node-*", "login-1"]
    assert speaks_for(key, "gpu-node-17") and speaks_for(key, "login-1")
    assert not speaks_for(key, "login-12")
    assert not speaks_for(key, "GPU-NODE-17")  # case-sensitive, on every platform
    assert not speaks_for(key, "other-gpu-node-1")
    anyone = create_key(session, scopes=[KeyScope.UPLOAD], name="any", now=NOW, nodes=["*"]).key
    assert speaks_for(anyone, "whatever")
    admin = create_key(session, scopes=[KeyScope.ADMIN], name="admin", now=NOW).key
    assert admin.nodes == [] and speaks_for(admin, "whatever")
    reader = create_key(session, scopes=[KeyScope.READ], name="reader", now=NOW).key
    assert not speaks_for(reader, "whatever")


@pytest.mark.parametrize(
    ("scopes", "nodes", "words"),
    [
        ([KeyScope.UPLOAD], [], "needs the node ids"),
        ([KeyScope.UPLOAD], [""], "node pattern"),
        ([KeyScope.UPLOAD], ["gpu\nnode"], "printable"),
        ([KeyScope.UPLOAD], ["x" * 201], "1 to 200"),
        ([KeyScope.UPLOAD], [f"n{i}" for i in range(101)], "at most 100"),
        ([KeyScope.ADMIN], ["n1"], "only an upload key"),
        ([KeyScope.UPLOAD, KeyScope.ADMIN], ["n1"], "only an upload key"),
        ([KeyScope.READ], ["n1"], "only an upload key"),
    ],
)
def test_node_patterns_must_fit_the_key(
    session: Session, scopes: list[KeyScope], nodes: list[str], words: str
) -> None:
    with pytest.raises(ValueError, match=words):
        create_key(session, scopes=scopes, name="bad", now=NOW, nodes=nodes)
    assert list_keys(session) == []
