"""The factors a replica applies: fitted from the store's ratios, stored, cached with a TTL.

An upload adds its ratios and notes which (estimator version, method, level) partitions they
changed, in its own transaction, and nothing more: its cost does not grow with the ratios
stored. A load (`load_factor_table`) first refits the partitions changed since the last
refit (`refresh_factors`: `fit_table` on each such partition's ratios, the same factors a
refit of everything gives, since every group lies within one method and level) and stores
their factors; then it reads the stored factors, whose number does not grow with the ratios.
Replicas refit one at a time (an advisory lock on PostgreSQL); the others read.

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
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from service.core.calibration import (
    EMPTY_TABLE,
    Factor,
    FactorTable,
    GroupKey,
    Level,
    Observation,
    Sample,
    Scope,
    fit_table,
)
from service.store.db import read_only_sessions
from service.store.models import CalibrationFactor
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


def fit_factor_table(
    session: Session,
    estimator_version: str,
    *,
    method: str | None = None,
    level: Level | None = None,
) -> FactorTable:
    """Fit every factor (of one method and level, if given) afresh from the raw ratios of one
    estimator version: the definition the stored factors are kept equal to."""
    rows = CalibrationRepository(session).observations(
        estimator_version, method=method, level=level
    )
    return fit_table(_observation(row) for row in rows)


def _factor_rows(
    estimator_version: str, table: FactorTable, fitted_at: datetime
) -> list[CalibrationFactor]:
    return [
        CalibrationFactor(
            estimator_version=estimator_version,
            method=key.method,
            level=key.level.value,
            scope=key.scope.value,
            model=key.model or "",
            variant=key.variant or "",
            ratio=factor.ratio,
            upper_multiplier=factor.upper_multiplier,
            nodes=factor.nodes,
            models=factor.models,
            rejected_nodes=list(factor.rejected_nodes),
            runs=factor.runs,
            oom_runs=factor.oom_runs,
            log_spread=factor.log_spread,
            clamped=factor.clamped,
            fitted_at=fitted_at,
        )
        for key, factor in table.factors.items()
    ]


def _stored(row: CalibrationFactor) -> tuple[GroupKey, Factor]:
    key = GroupKey(
        scope=Scope(row.scope),
        method=row.method,
        level=Level(row.level),
        model=row.model or None,
        variant=row.variant or None,
    )
    factor = Factor(
        ratio=row.ratio,
        upper_multiplier=row.upper_multiplier,
        nodes=row.nodes,
        models=row.models,
        rejected_nodes=tuple(row.rejected_nodes),
        runs=row.runs,
        oom_runs=row.oom_runs,
        log_spread=row.log_spread,
        clamped=row.clamped,
    )
    return key, factor


@dataclass(frozen=True, slots=True, kw_only=True)
class _Refit:
    """Partitions fitted from the ratios a session saw, and the changes that fit covers."""

    change_ids: dict[tuple[str, str], list[int]]  # (method, level) -> its changes' ids
    tables: dict[tuple[str, str], FactorTable]


def _fit_changed(session: Session, estimator_version: str) -> _Refit:
    changes = CalibrationRepository(session).changes(estimator_version)
    change_ids: dict[tuple[str, str], list[int]] = {}
    for change_id, method, level in changes:
        change_ids.setdefault((method, level), []).append(change_id)
    # The ratios are read after the changes: every change seen is covered by the fit.
    tables = {
        (method, level): fit_factor_table(
            session, estimator_version, method=method, level=Level(level)
        )
        for method, level in sorted(change_ids)
    }
    return _Refit(change_ids=change_ids, tables=tables)


def _store_refit(
    session: Session, estimator_version: str, refit: _Refit, fitted_at: datetime
) -> int:
    """Store the fitted partitions whose changes no other refit has covered meanwhile (one
    that did read more ratios than this one); returns how many were stored."""
    repository = CalibrationRepository(session)
    repository.lock_refit(estimator_version)
    pending = {change_id for change_id, _method, _level in repository.changes(estimator_version)}
    stored = 0
    for partition, ids in refit.change_ids.items():
        if not pending.intersection(ids):
            continue
        method, level = partition
        rows = _factor_rows(estimator_version, refit.tables[partition], fitted_at)
        repository.replace_factors(estimator_version, method, level, rows)
        repository.forget_changes(ids)
        stored += 1
    session.flush()
    return stored


def refresh_factors(
    session: Session, estimator_version: str, *, now: Callable[[], datetime] | None = None
) -> int:
    """Refit the partitions whose ratios changed since their last refit and store their
    factors, in one transaction; returns how many partitions were refitted. The caller
    commits."""
    CalibrationRepository(session).lock_refit(estimator_version)
    refit = _fit_changed(session, estimator_version)
    if not refit.change_ids:
        return 0
    return _store_refit(session, estimator_version, refit, (now or _utc_now)())


def _utc_now() -> datetime:
    return datetime.now(UTC)


def stored_factor_table(session: Session, estimator_version: str) -> FactorTable:
    """The stored factors of one estimator version, as the last refit left them."""
    rows = CalibrationRepository(session).factors(estimator_version)
    return FactorTable(dict(_stored(row) for row in rows)) if rows else EMPTY_TABLE


def load_factor_table(session: Session, estimator_version: str) -> FactorTable:
    """The factors of one estimator version, refitting the partitions that changed first."""
    refresh_factors(session, estimator_version)
    return stored_factor_table(session, estimator_version)


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

    readers = read_only_sessions(sessions)

    def load() -> FactorTable:
        # The fit reads in a read-only transaction (on SQLite, one that neither takes nor
        # waits for the write lock, so uploads go on meanwhile); only storing its result
        # writes, briefly.
        with readers() as session:
            refit = _fit_changed(session, estimator_version)
        if refit.change_ids:
            with sessions.begin() as session:
                _store_refit(session, estimator_version, refit, _utc_now())
        with readers() as session:
            return stored_factor_table(session, estimator_version)

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
