"""The factors a replica applies: fitted from the store's ratios, stored, cached with a TTL.

An upload adds its ratios and notes which model of which (estimator version, method, level)
partition they changed, in its own transaction, and nothing more: its cost does not grow with
the ratios stored. A load (`load_factor_table`) first refits what changed since the last
refit (`refresh_factors`) and stores those factors; then it reads the stored factors, whose
number does not grow with the ratios. A refit fits each changed model's factors and its
partition's global one with the core's rules (`fit_model_factors`, `fit_global_runs`) over
runs that the database summarises (`StoredRuns`): each voter's median per model and the few
order statistics of the safe bound, by queries, so no run is read into Python; the global
factor reads the votes kept per (model, voter) (`PartitionRuns`) and a top-k query. A voter
is the key an upload came with (each ratio carries its prefix), never the node id it names.
Every group lies within one method and level, and a model's groups within the model, so the
factors equal those of `fit_table` on every ratio (`fit_factor_table`, the definition).
Replicas store refits one at a time (an advisory lock on PostgreSQL); the others read.

Requests only read the cache (`FactorCache.peek`); `keep_fresh` reloads it in a worker thread.
When the store is down, the cache keeps the last factors loaded (`stale`) or none (`none`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import astuple, dataclass, replace
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from service.core.calibration import (
    COMPLETED,
    EMPTY_TABLE,
    Factor,
    FactorTable,
    GroupKey,
    Level,
    Observation,
    Outcome,
    Pair,
    Runs,
    Sample,
    Scope,
    Selection,
    Window,
    fit_global_runs,
    fit_model_factors,
    fit_table,
)
from service.store.db import read_only_sessions, write_refusal
from service.store.models import CalibrationFactor, CalibrationVote
from service.store.repositories import CalibrationRepository, RatioGroup

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
        sample=Sample(voter=row.voter, ratio=row.ratio, outcome=row.outcome),
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


class StoredRuns:
    """A group's runs as the store's queries answer them (`Runs`): the votes from each
    (model, voter)'s middle runs, counts and ranked ratios from top-k queries."""

    def __init__(self, repository: CalibrationRepository, group: RatioGroup) -> None:
        self._repository = repository
        self._group = group
        self._votes: dict[Pair, float] | None = None
        self._completed_runs: dict[Pair, int] = {}

    def votes(self) -> Mapping[Pair, float]:
        if self._votes is None:
            middles: dict[Pair, list[float]] = defaultdict(list)
            for model, voter, ratio, runs in self._repository.middle_runs(self._group):
                middles[(model, voter)].append(math.log(ratio))
                self._completed_runs[(model, voter)] = runs
            # The median of the logs, as `voter_votes` takes it: the middle one, or the mean
            # of the middle two.
            self._votes = {
                pair: logs[0] if len(logs) == 1 else (logs[0] + logs[1]) / 2
                for pair, logs in middles.items()
            }
        return self._votes

    def completed_runs(self) -> Mapping[Pair, int]:
        """Each (model, voter)'s number of completed runs."""
        self.votes()
        return self._completed_runs

    def completed(self, selection: Selection) -> int:
        return self._repository.count_runs(self._group, selection, Outcome.COMPLETED, above=None)

    def oom_above(self, selection: Selection, bound: float) -> int:
        return self._repository.count_runs(self._group, selection, Outcome.OOM, above=bound)

    def largest(self, selection: Selection, rank: int, window: Window = COMPLETED) -> float:
        return self._repository.ranked_ratio(
            self._group, selection, rank, oom_above=window.oom_above, at_most=window.at_most
        )


class PartitionRuns(StoredRuns):
    """A partition's runs, for its global factor: the votes the store keeps per (model, voter)
    (`calibration_vote`), those of the models refitted now taken from their fresh runs, and
    run counts summed from them, so no query reads every run for them; the ranked ratios of
    the safe bound are still queried over the partition's runs."""

    def __init__(
        self,
        repository: CalibrationRepository,
        group: RatioGroup,
        fresh: Mapping[str, StoredRuns],
    ) -> None:
        super().__init__(repository, group)
        votes: dict[Pair, float] = {}
        for row in repository.votes(group.estimator_version, group.method, group.level):
            if row.model not in fresh:
                votes[(row.model, row.voter)] = row.log_vote
                self._completed_runs[(row.model, row.voter)] = row.completed_runs
        for runs in fresh.values():
            votes.update(runs.votes())
            self._completed_runs.update(runs.completed_runs())
        self._votes = votes

    def completed(self, selection: Selection) -> int:
        return sum(
            runs
            for (model, voter), runs in self._completed_runs.items()
            if selection.supports(model, voter)
        )


# A voter's vote on a model: (model, voter, log vote, completed runs).
VoteRow = tuple[str, str, float, int]


@dataclass(frozen=True, slots=True, kw_only=True)
class PartitionFit:
    factors: dict[GroupKey, Factor]  # the refitted models', and the partition's global one
    votes: list[VoteRow]  # the refitted models' voters' votes


def fit_partition(
    repository: CalibrationRepository,
    estimator_version: str,
    method: str,
    level: str,
    models: list[str],
) -> PartitionFit:
    """The factors of `models` in one partition and the partition's global factor, from the
    store's summaries of their runs and the votes it keeps of the other models."""
    partition = RatioGroup(estimator_version=estimator_version, method=method, level=level)
    factors: dict[GroupKey, Factor] = {}
    fresh: dict[str, StoredRuns] = {}
    for model in models:
        group = replace(partition, model=model)
        runs = fresh[model] = StoredRuns(repository, group)
        gpus, environments = repository.variants(group)
        variants: dict[tuple[Scope, str], Runs] = {
            (Scope.MODEL_GPU, gpu): StoredRuns(repository, replace(group, gpu_name=gpu))
            for gpu in gpus
        }
        variants.update(
            {
                (Scope.MODEL_ENVIRONMENT, key): StoredRuns(
                    repository, replace(group, environment_key=key)
                )
                for key in environments
            }
        )
        factors.update(
            fit_model_factors(
                model=model, method=method, level=Level(level), runs=runs, variants=variants
            )
        )
    found = fit_global_runs(PartitionRuns(repository, partition, fresh))
    if found is not None:
        factors[GroupKey(scope=Scope.GLOBAL, method=method, level=Level(level))] = found
    votes = [
        (model, voter, vote, runs.completed_runs()[(model, voter)])
        for runs in fresh.values()
        for (model, voter), vote in runs.votes().items()
    ]
    return PartitionFit(factors=factors, votes=votes)


@dataclass(frozen=True, slots=True, kw_only=True)
class _PartitionRefit:
    change_ids: list[int]  # the changes this refit covers
    models: list[str]  # the models refitted
    fit: PartitionFit


def _fit_changed(
    session: Session, estimator_version: str
) -> dict[tuple[str, str], _PartitionRefit]:
    """Refits of every (method, level) partition with changes, of its changed models."""
    repository = CalibrationRepository(session)
    change_ids: dict[tuple[str, str], list[int]] = defaultdict(list)
    changed: dict[tuple[str, str], set[str] | None] = {}
    for change in repository.changes(estimator_version):
        partition = (change.method, change.level)
        change_ids[partition].append(change.id)
        named = changed.setdefault(partition, set())
        if change.model is None:
            changed[partition] = None  # every model of the partition
        elif named is not None:
            named.add(change.model)
    # The runs are read after the changes: every change seen is covered by the fit.
    refits = {}
    for partition, ids in sorted(change_ids.items()):
        method, level = partition
        names = changed[partition]
        models = (
            repository.models(estimator_version, method, level) if names is None else sorted(names)
        )
        refits[partition] = _PartitionRefit(
            change_ids=ids,
            models=models,
            fit=fit_partition(repository, estimator_version, method, level, models),
        )
    return refits


def _store_refit(
    session: Session,
    estimator_version: str,
    refits: Mapping[tuple[str, str], _PartitionRefit],
    fitted_at: datetime,
) -> int:
    """Store the refitted partitions none of whose changes another refit covered meanwhile
    (one that did may have read more runs than this one; the changes it left are refitted
    next time); returns how many were stored."""
    repository = CalibrationRepository(session)
    repository.lock_refit(estimator_version)
    pending = {change.id for change in repository.changes(estimator_version)}
    stored = 0
    for (method, level), refit in refits.items():
        if not pending.issuperset(refit.change_ids):
            continue
        rows = _factor_rows(estimator_version, FactorTable(refit.fit.factors), fitted_at)
        repository.replace_factors(estimator_version, method, level, refit.models, rows)
        votes = [
            CalibrationVote(
                estimator_version=estimator_version,
                method=method,
                level=level,
                model=model,
                voter=voter,
                log_vote=vote,
                completed_runs=runs,
            )
            for model, voter, vote, runs in refit.fit.votes
        ]
        repository.replace_votes(estimator_version, method, level, refit.models, votes)
        repository.forget_changes(refit.change_ids)
        stored += 1
    session.flush()
    return stored


def refresh_factors(
    session: Session, estimator_version: str, *, now: Callable[[], datetime] | None = None
) -> int:
    """Refit the models (and their partitions' global factors) whose ratios changed since
    their last refit and store their factors, in one transaction; returns how many
    partitions were refitted. The caller commits."""
    CalibrationRepository(session).lock_refit(estimator_version)
    refits = _fit_changed(session, estimator_version)
    if not refits:
        return 0
    return _store_refit(session, estimator_version, refits, (now or _utc_now)())


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
    table_id: str | None = None  # `table_identity(table)`; None: nothing loaded yet


# Hex digits of a factor table's identity (64 bits): distinct for the tables a deployment loads.
TABLE_ID_HEX_DIGITS = 16


def table_identity(table: FactorTable) -> str:
    """A digest of every factor of `table` (its group and all its values): the same on every
    replica that loaded the same factors, whenever it loaded them."""
    digest = hashlib.sha256()
    for key, factor in sorted(table.factors.items(), key=lambda item: _group_order(item[0])):
        digest.update(repr((astuple(key), astuple(factor))).encode())
    return digest.hexdigest()[:TABLE_ID_HEX_DIGITS]


def _group_order(key: GroupKey) -> tuple[str, str, str, str, str]:
    return (key.scope.value, key.method, key.level.value, key.model or "", key.variant or "")


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
                table_id=previous.table_id,
            )
            self._next_load = now + self._retry_s
            return
        self._snapshot = FactorSnapshot(
            table=table,
            state=FactorState.FRESH,
            loaded_at=now,
            error=None,
            table_id=table_identity(table),
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
            refits = _fit_changed(session, estimator_version)
        if refits:
            try:
                with sessions.begin() as session:
                    _store_refit(session, estimator_version, refits, _utc_now())
            except DBAPIError as error:
                # A store that refuses writes (read-only, full) or a refit lock another
                # replica holds: the stored factors still serve; the changes wait for a
                # later load.
                if not _store_declined(error):
                    raise
                logger.warning("the refitted factors were not stored: %s", error.orig)
        with readers() as session:
            return stored_factor_table(session, estimator_version)

    return load


def _store_declined(error: DBAPIError) -> bool:
    sqlstate = getattr(error.orig, "sqlstate", None)
    return write_refusal(error) is not None or sqlstate == LOCK_NOT_AVAILABLE


# PostgreSQL's SQLSTATE of a lock not granted within `lock_timeout`.
LOCK_NOT_AVAILABLE = "55P03"


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
