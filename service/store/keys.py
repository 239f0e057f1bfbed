"""API keys: a random token shown once, stored only as its SHA-256, with scopes.

A token reads `vck_<prefix>_<secret>`: the prefix (8 hex digits) names the key in listings
and revocation, the secret carries 256 random bits. Hashing with a plain SHA-256 is enough
for a random secret of that length (no dictionary to guard against, unlike a password).

An upload key speaks for the node ids it was made for (`nodes`: ids or shell-style patterns
such as `gpu-node-*`, `*` for any), fixed when it is made; an upload naming another node id
is refused. An admin key speaks for any node id. Whatever node ids its uploads name, a key
casts one calibration vote (`service.core.calibration`): node ids say where a run ran, the
key says who vouches for it. Upload keys made before keys named their nodes were given `*`
by the upgrade that added them: they keep uploading for any node id, one vote each.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from fnmatch import fnmatchcase

from sqlalchemy.orm import Session

from service.store.models import ApiKey
from service.store.repositories import ApiKeyRepository, KeyUsage

TOKEN_PREFIX = "vck"
PREFIX_BYTES = 4  # 8 hex digits: unique enough to name a key, checked on creation
SECRET_BYTES = 32  # 256 bits of entropy
# A node pattern is at most as long as the node id it matches (the upload's column), and
# printable.
MAX_NODE_PATTERN = 200
NODE_PATTERN = re.compile(rf"^[^\x00-\x1f\x7f]{{1,{MAX_NODE_PATTERN}}}$")
# Node patterns one key may hold: a fleet binds a key to a few names or one pattern.
MAX_NODE_PATTERNS = 100
# What a prefix looks like (PREFIX_BYTES hex digits), for callers that take one as input.
PREFIX_PATTERN = re.compile(rf"^[0-9a-f]{{{2 * PREFIX_BYTES}}}$")


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


class NodeNotAllowedError(Exception):
    """An upload names a node id its key was not made for."""

    def __init__(self, node_id: str, prefix: str) -> None:
        super().__init__(f"key {prefix} may not upload for node_id {node_id!r}")
        self.node_id = node_id
        self.prefix = prefix


def speaks_for(key: ApiKey, node_id: str) -> bool:
    """Whether `key` may upload runs as `node_id`: an admin key for any node id, an upload
    key for the ids its node patterns match (case-sensitive shell-style: `*`, `?`, `[...]`)."""
    if KeyScope.ADMIN.value in key.scopes:
        return True
    return KeyScope.UPLOAD.value in key.scopes and any(
        fnmatchcase(node_id, pattern) for pattern in key.nodes
    )


def _node_patterns(chosen: list[KeyScope], nodes: Iterable[str]) -> list[str]:
    """The node patterns of a new key with `chosen` scopes; ValueError when they do not fit."""
    patterns = list(dict.fromkeys(nodes))
    for pattern in patterns:
        if not NODE_PATTERN.match(pattern):
            raise ValueError(
                f"node pattern {pattern[:MAX_NODE_PATTERN]!r}: 1 to {MAX_NODE_PATTERN} "
                "printable characters"
            )
    if len(patterns) > MAX_NODE_PATTERNS:
        raise ValueError(f"a key takes at most {MAX_NODE_PATTERNS} node patterns")
    if KeyScope.ADMIN in chosen or KeyScope.UPLOAD not in chosen:
        if patterns:
            raise ValueError(
                "only an upload key names its nodes (an admin key speaks for every node)"
            )
    elif not patterns:
        raise ValueError(
            "an upload key needs the node ids it may upload for (a pattern such as "
            "'gpu-node-*'; '*' for any node id)"
        )
    return patterns


def create_key(
    session: Session,
    *,
    scopes: Iterable[KeyScope],
    name: str,
    now: datetime,
    nodes: Iterable[str] = (),
) -> IssuedKey:
    """A new key with `scopes`; an upload key (without the admin scope) must name the node ids
    it may upload for, as ids or patterns (`speaks_for`), and only such a key names any."""
    repository = ApiKeyRepository(session)
    chosen = sorted({KeyScope(scope) for scope in scopes})
    if not chosen:
        raise ValueError("a key needs at least one scope")
    patterns = _node_patterns(chosen, nodes)
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
            nodes=patterns,
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


def key_usage(session: Session, *, include_revoked: bool = False) -> list[KeyUsage]:
    """Each key with how many calibration uploads it made, oldest key first."""
    return list(ApiKeyRepository(session).usage(include_revoked=include_revoked))
