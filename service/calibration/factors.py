"""The factors a replica applies: fitted from the store's ratios, cached with a TTL.

Requests only read the cache (`FactorCache.peek`); `keep_fresh` reloads it in a worker thread.
When the store is down, the cache keeps the last factors loaded (`stale`) or none (`none`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from service.core.calibration import EMPTY_TABLE, FactorTable, Observation, Sample, fit_table
from service.store.repositories import CalibrationRepository

# Factors a replica serves are at most this old: with one load it stays within the 10 s in
# which an upload must reach every replica's answers.
FACTOR_TTL_S = 5.0
# After a failed load (database down), wait this long before trying again, so requests keep
# answering from the cache instead of each waiting on a connection timeout.
FACTOR_RETRY_S = 2.0


def environment_key(environment: Mapping[str, Any]) -> str:
    """The part of an environment that changes memory: torch and CUDA, major.minor."""

    def major_minor(name: str) -> str:
        value = environment.get(name)
        if not isinstance(value, str) or not value:
            return "?"
        return ".".join(value.split("+")[0].split(".")[:2])

    return f"torch {major_minor('torch')}, cuda {major_minor('cuda')}"


def _observation(row: Any) -> Observation:
    return Observation(
        model=row.model,
        method=row.method,
        level=row.level,
        gpu=row.gpu_name,
        environment=environment_key(row.environment),
        sample=Sample(node_id=row.node_id, ratio=row.ratio, outcome=row.outcome),
    )


def load_factor_table(session: Session, estimator_version: str) -> FactorTable:
    """Fit every factor afresh from the raw ratios of one estimator version."""
    rows = CalibrationRepository(session).observations(estimator_version)
    return fit_table(_observation(row) for row in rows)


class FactorState(StrEnum):
    FRESH = "fresh"  # loaded from the store within the TTL
    STALE = "stale"  # the store could not be read: the last factors loaded
    NONE = "none"  # the store could not be read and nothing was ever loaded: uncalibrated


@dataclass(frozen=True, slots=True, kw_only=True)
class FactorSnapshot:
    table: FactorTable
    state: FactorState
    loaded_at: float | None  # clock reading of the last successful load
    error: str | None  # why the last load failed, while not fresh


class FactorCache:
    """A replica's factors, reloaded from the store when older than `ttl_s`.

    When the store is down, it keeps answering with the last factors (or none) and says so.
    One thread reloads at a time; the others meanwhile get what is cached.
    """

    def __init__(
        self,
        load: Callable[[], FactorTable],
        *,
        ttl_s: float = FACTOR_TTL_S,
        retry_s: float = FACTOR_RETRY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._load = load
        self._ttl_s = ttl_s
        self._retry_s = retry_s
        self._clock = clock
        self._lock = threading.Lock()
        self._snapshot = FactorSnapshot(
            table=EMPTY_TABLE, state=FactorState.NONE, loaded_at=None, error="not loaded yet"
        )
        self._next_load = float("-inf")
        self._invalidations = 0

    def get(self) -> FactorSnapshot:
        if self._clock() < self._next_load:
            return self._snapshot
        # The first load is waited for; later reloads are not, the cached table serves.
        if not self._lock.acquire(blocking=self._snapshot.loaded_at is None):
            return self._snapshot
        try:
            now = self._clock()
            if now >= self._next_load:
                self._refresh(now)
            return self._snapshot
        finally:
            self._lock.release()

    def peek(self) -> FactorSnapshot:
        """The cached factors, never loading: for request paths that must not wait on the
        database, while a background task calls `get` to keep them fresh."""
        return self._snapshot

    def age_s(self, snapshot: FactorSnapshot) -> float | None:
        """Seconds since `snapshot` was loaded, by this cache's clock; None: never loaded."""
        return None if snapshot.loaded_at is None else max(self._clock() - snapshot.loaded_at, 0.0)

    def invalidate(self) -> None:
        """Reload on the next `get` (after this replica stored an upload), also when a load
        that began before the upload was stored is under way."""
        self._invalidations += 1
        self._next_load = float("-inf")

    def _refresh(self, now: float) -> None:
        invalidations = self._invalidations
        try:
            table = self._load()
        except SQLAlchemyError as error:
            previous = self._snapshot
            self._snapshot = FactorSnapshot(
                table=previous.table,
                state=FactorState.NONE if previous.loaded_at is None else FactorState.STALE,
                loaded_at=previous.loaded_at,
                error=f"calibration store unavailable: {type(error).__name__}",
            )
            self._next_load = now + self._retry_s
            return
        self._snapshot = FactorSnapshot(
            table=table, state=FactorState.FRESH, loaded_at=now, error=None
        )
        invalidated = self._invalidations != invalidations
        self._next_load = float("-inf") if invalidated else now + self._ttl_s


def factor_loader(
    sessions: sessionmaker[Session], estimator_version: str
) -> Callable[[], FactorTable]:
    """A FactorCache loader reading the store in its own short session."""

    def load() -> FactorTable:
        with sessions() as session:
            return load_factor_table(session, estimator_version)

    return load


# How often a replica checks whether its factors are due for a reload (their TTL passed, or
# an upload invalidated them): factors are at most the cache's TTL plus this old.
REFRESH_TICK_S = 1.0

logger = logging.getLogger(__name__)


async def keep_fresh(cache: FactorCache, tick_s: float = REFRESH_TICK_S) -> None:
    """Reload `cache` in a worker thread whenever it is due; runs until cancelled."""
    while True:
        await asyncio.sleep(tick_s)
        try:
            await asyncio.to_thread(cache.get)
        except Exception:
            # The cache turns database errors into a stale state; anything else is a bug,
            # and the next tick tries again.
            logger.exception("reloading the calibration factors failed")
