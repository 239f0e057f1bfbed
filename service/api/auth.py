"""API keys on requests: a bearer token (`vramcast keys create`) with the scope a route needs.

Uploads check their key in the store, in the upload's own transaction. Reads check it through
a small cache in the process (`KeyCache`), so that GET /v1/factors answers while the store is
down: a key the store verified less than `KEY_RECHECK_S` ago is taken without asking it again
(so a revocation reaches every replica within that time), and while the store cannot be
reached, a key it verified less than `KEY_OUTAGE_GRACE_S` ago is still taken. A key the cache
does not know while the store is down gets 503 (it may be valid), never 401.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from sqlalchemy.orm import Session

from service.api import problems
from service.api.problems import ProblemError
from service.store.db import store_unreachable
from service.store.keys import KeyScope, allows, authenticate, hash_token
from service.store.models import ApiKey

api_key = HTTPBearer(
    scheme_name="ApiKey",
    description="An API key from `vramcast keys create`, sent as `Authorization: Bearer vck_...`.",
    auto_error=False,
)

# Seconds a read key the store verified is taken without asking the store again: a revoked
# key stops working on every replica within this time.
KEY_RECHECK_S = 30.0
# Seconds a read key the store verified keeps working while the store cannot be reached: a
# database restart or failover takes seconds to minutes; a revocation made just before an
# outage is not seen for longer than this.
KEY_OUTAGE_GRACE_S = 900.0
# Keys the cache remembers (the least recently verified leave first): a deployment has a few.
KEY_CACHE_ENTRIES = 4096


def require_key(
    session: Session, credentials: HTTPAuthorizationCredentials | None, scope: KeyScope
) -> ApiKey:
    """The live key the request carries, with `scope`; a 401 or 403 problem otherwise."""
    if credentials is None:
        raise ProblemError(problems.unauthorized("this request needs an API key (Bearer)"))
    key = authenticate(session, credentials.credentials)
    if key is None:
        raise ProblemError(problems.unauthorized("the API key is unknown or revoked"))
    if not allows(key, scope):
        raise ProblemError(problems.forbidden(scope.value))
    return key


@dataclass(frozen=True, slots=True)
class VerifiedKey:
    """What the cache keeps of a key the store verified (never the token itself)."""

    key_id: int
    scopes: tuple[str, ...]
    verified_at: float  # the cache's clock reading


class KeyCache:
    """Keys the store verified lately, by their token's hash (`hash_token`)."""

    def __init__(
        self,
        *,
        recheck_s: float = KEY_RECHECK_S,
        outage_grace_s: float = KEY_OUTAGE_GRACE_S,
        entries: int = KEY_CACHE_ENTRIES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.recheck_s = recheck_s
        self.outage_grace_s = outage_grace_s
        self._entries = entries
        self._clock = clock
        self._lock = threading.Lock()
        self._keys: OrderedDict[str, VerifiedKey] = OrderedDict()

    def verified_within(self, digest: str, seconds: float) -> VerifiedKey | None:
        found = self._keys.get(digest)
        if found is None or self._clock() - found.verified_at > seconds:
            return None
        return found

    def remember(self, digest: str, key: ApiKey) -> None:
        verified = VerifiedKey(key_id=key.id, scopes=tuple(key.scopes), verified_at=self._clock())
        with self._lock:
            self._keys[digest] = verified
            self._keys.move_to_end(digest)
            while len(self._keys) > self._entries:
                self._keys.popitem(last=False)

    def forget(self, digest: str) -> None:
        with self._lock:
            self._keys.pop(digest, None)

    def forget_key(self, key_id: int) -> None:
        """Drop every token of the key `key_id` (revoked here: this replica stops taking it at
        once; the others within `recheck_s`)."""
        with self._lock:
            for digest in [d for d, found in self._keys.items() if found.key_id == key_id]:
                del self._keys[digest]


def _scoped(scopes: tuple[str, ...], scope: KeyScope) -> None:
    if scope.value not in scopes and KeyScope.ADMIN.value not in scopes:
        raise ProblemError(problems.forbidden(scope.value))


def require_cached_key(
    cache: KeyCache,
    session: Session,
    credentials: HTTPAuthorizationCredentials | None,
    scope: KeyScope,
) -> None:
    """As `require_key`, through `cache`: the store is asked only for a key not verified
    within `recheck_s`, and while it cannot be reached a key verified within
    `outage_grace_s` is taken; any other key is then a 503 (the store's error)."""
    if credentials is None:
        raise ProblemError(problems.unauthorized("this request needs an API key (Bearer)"))
    digest = hash_token(credentials.credentials)
    recent = cache.verified_within(digest, cache.recheck_s)
    if recent is not None:
        _scoped(recent.scopes, scope)
        return
    try:
        key = authenticate(session, credentials.credentials)
    except (DBAPIError, PoolTimeoutError) as error:
        known = cache.verified_within(digest, cache.outage_grace_s)
        if known is None or not store_unreachable(error):
            raise
        _scoped(known.scopes, scope)
        return
    if key is None:
        cache.forget(digest)
        raise ProblemError(problems.unauthorized("the API key is unknown or revoked"))
    cache.remember(digest, key)
    _scoped(tuple(key.scopes), scope)
