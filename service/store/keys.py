"""API keys: a random token shown once, stored only as its SHA-256, with scopes.

A token reads `vck_<prefix>_<secret>`: the prefix (8 hex digits) names the key in listings
and revocation, the secret carries 256 random bits. Hashing with a plain SHA-256 is enough
for a random secret of that length (no dictionary to guard against, unlike a password).
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from sqlalchemy.orm import Session

from service.store.models import ApiKey
from service.store.repositories import ApiKeyRepository

TOKEN_PREFIX = "vck"
PREFIX_BYTES = 4  # 8 hex digits: unique enough to name a key, checked on creation
SECRET_BYTES = 32  # 256 bits of entropy


class KeyScope(StrEnum):
    READ = "read"  # estimates, fit-checks, factors and calibrations, when reads need a key
    UPLOAD = "upload"  # calibration uploads from training nodes
    ADMIN = "admin"  # everything


@dataclass(frozen=True, slots=True, kw_only=True)
class IssuedKey:
    key: ApiKey
    token: str  # shown once; only its hash is stored


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_key(
    session: Session, *, scopes: Iterable[KeyScope], name: str, now: datetime
) -> IssuedKey:
    repository = ApiKeyRepository(session)
    chosen = sorted({KeyScope(scope) for scope in scopes})
    if not chosen:
        raise ValueError("a key needs at least one scope")
    prefix = secrets.token_hex(PREFIX_BYTES)
    while repository.get_by_prefix(prefix) is not None:
        prefix = secrets.token_hex(PREFIX_BYTES)
    token = f"{TOKEN_PREFIX}_{prefix}_{secrets.token_urlsafe(SECRET_BYTES)}"
    key = repository.add(
        ApiKey(
            prefix=prefix,
            key_hash=hash_token(token),
            name=name,
            scopes=[scope.value for scope in chosen],
            created_at=now,
        )
    )
    return IssuedKey(key=key, token=token)


def authenticate(session: Session, token: str) -> ApiKey | None:
    """The live key a token belongs to; None for a malformed, unknown or revoked token."""
    if not token.startswith(f"{TOKEN_PREFIX}_"):
        return None
    key = ApiKeyRepository(session).get_by_hash(hash_token(token))
    if key is None or key.revoked_at is not None:
        return None
    return key


def allows(key: ApiKey, scope: KeyScope) -> bool:
    return scope.value in key.scopes or KeyScope.ADMIN.value in key.scopes


def revoke_key(session: Session, prefix: str, *, now: datetime) -> ApiKey | None:
    """Revoke the key with this prefix; None when there is none. Revoking twice is a no-op."""
    repository = ApiKeyRepository(session)
    key = repository.get_by_prefix(prefix)
    if key is not None:
        repository.revoke(key, now)
    return key


def list_keys(session: Session, *, include_revoked: bool = False) -> list[ApiKey]:
    return list(ApiKeyRepository(session).list_keys(include_revoked=include_revoked))
