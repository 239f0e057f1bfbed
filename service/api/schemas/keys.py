"""Bodies of the key routes: API keys as an operator sees them, never their secrets."""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from service.api.schemas.base import In, Out
from service.calibration.uploads import Purge, Revocation
from service.store.keys import MAX_NODE_PATTERNS, KeyScope
from service.store.models import PREFIX_LENGTH
from service.store.repositories import KeyUsage

# Keys a listing holds at most: an operator's keys, one per training node or fleet.
MAX_KEYS = 100_000


class KeyOut(Out):
    """An API key, by its prefix, with the calibration uploads stored under it."""

    prefix: str = Field(max_length=PREFIX_LENGTH, description="Names the key; its voter id.")
    name: str = Field(max_length=200, description="What the key is for.")
    scopes: list[KeyScope] = Field(max_length=len(KeyScope), description="What it may do.")
    nodes: list[str] = Field(
        max_length=MAX_NODE_PATTERNS,
        description="The node ids (shell-style patterns) an upload key may upload for; empty "
        "for other keys (an admin key uploads for any).",
    )
    created_at: datetime = Field(description="When it was made (UTC).")
    revoked_at: datetime | None = Field(description="When it was revoked; null: live.")
    uploads: int = Field(ge=0, description="Calibration uploads stored under it.")
    last_upload_at: datetime | None = Field(description="Its latest upload; null: none.")

    @classmethod
    def from_core(cls, usage: KeyUsage) -> KeyOut:
        key = usage.key
        return cls(
            prefix=key.prefix,
            name=key.name,
            scopes=[KeyScope(scope) for scope in key.scopes],
            nodes=list(key.nodes),
            created_at=key.created_at,
            revoked_at=key.revoked_at,
            uploads=usage.uploads,
            last_upload_at=usage.last_upload_at,
        )


class KeyListOut(Out):
    """API keys, with what each uploaded."""

    keys: list[KeyOut] = Field(max_length=MAX_KEYS, description="Oldest first.")


class KeyFilterIn(In):
    """Which keys to list."""

    all: bool = Field(default=False, description="Include revoked keys.")


class PurgeOut(Out):
    """What purging a key's uploads deleted and refitted."""

    uploads: int = Field(ge=0, description="Uploads deleted.")
    ratios: int = Field(ge=0, description="Their ratios deleted.")
    refitted: int = Field(
        ge=0, description="Partitions (method, level) whose factors were refitted without them."
    )

    @classmethod
    def from_core(cls, purge: Purge) -> PurgeOut:
        return cls(uploads=purge.uploads, ratios=purge.ratios, refitted=purge.refitted)


class RevocationOut(Out):
    """A revoked key; with `purge`, what was deleted."""

    prefix: str = Field(max_length=PREFIX_LENGTH, description="The key revoked.")
    revoked_at: datetime = Field(description="When it was revoked (the first time).")
    purge: PurgeOut | None = Field(description="What the purge deleted; null: no purge asked.")

    @classmethod
    def from_core(cls, revocation: Revocation) -> RevocationOut:
        return cls(
            prefix=revocation.key.prefix,
            revoked_at=revocation.revoked_at,
            purge=None if revocation.purge is None else PurgeOut.from_core(revocation.purge),
        )
