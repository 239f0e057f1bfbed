"""API keys: shown once, stored as a hash, scoped, revocable."""

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
)

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def test_a_new_key_is_stored_only_as_its_hash(session: Session) -> None:
    issued = create_key(session, scopes=[KeyScope.UPLOAD], name="fleet", now=NOW)
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
    issued = create_key(session, scopes=[KeyScope.UPLOAD], name="fleet", now=NOW)
    assert revoke_key(session, issued.key.prefix, now=NOW) is issued.key
    assert authenticate(session, issued.token) is None
    assert revoke_key(session, issued.key.prefix, now=NOW) is issued.key
    assert revoke_key(session, "00000000", now=NOW) is None
    assert list_keys(session) == []
    assert list_keys(session, include_revoked=True) == [issued.key]


def test_scopes_and_admin(session: Session) -> None:
    upload = create_key(session, scopes=[KeyScope.UPLOAD], name="u", now=NOW).key
    admin = create_key(session, scopes=[KeyScope.ADMIN], name="a", now=NOW).key
    both = create_key(session, scopes=[KeyScope.READ, KeyScope.UPLOAD], name="b", now=NOW).key
    assert allows(upload, KeyScope.UPLOAD)
    assert not allows(upload, KeyScope.READ)
    assert not allows(upload, KeyScope.ADMIN)
    assert all(allows(admin, scope) for scope in KeyScope)
    assert allows(both, KeyScope.READ) and allows(both, KeyScope.UPLOAD)
    assert both.scopes == ["read", "upload"]


def test_a_key_needs_a_scope(session: Session) -> None:
    with pytest.raises(ValueError, match="scope"):
        create_key(session, scopes=[], name="none", now=NOW)
