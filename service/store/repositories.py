"""All SQL of the store. Repositories flush and never commit: the caller's unit of work does."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import and_, delete, exists, func, or_, select, text, tuple_
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, joinedload
from sqlalchemy.sql import Select

from service.core.calibration import Level, Outcome, Scope, Selection
from service.store.models import (
    ApiKey,
    CalibrationChange,
    CalibrationFactor,
    CalibrationRatio,
    CalibrationRederivation,
    CalibrationUpload,
    CalibrationVote,
)

# PostgreSQL advisory lock class (the first key) that serialises refits of one estimator
# version's factors (the second key: hashtext of the version) across replicas.
REFIT_LOCK_CLASS = 0x76726D63  # "vrmc"


class DuplicateIdempotencyKeyError(Exception):
    """Another upload already holds this (API key, Idempotency-Key) pair: `existing`."""

    def __init__(self, existing: CalibrationUpload) -> None:
        super().__init__(f"Idempotency-Key {existing.idempotency_key!r} is already used")
        self.existing = existing


@dataclass(frozen=True, slots=True, kw_only=True)
class KeyUsage:
    """A key and the calibration uploads stored under it."""

    key: ApiKey
    uploads: int
    last_upload_at: datetime | None


class ApiKeyRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def add(self, key: ApiKey) -> ApiKey:
        self.session.add(key)
        self.session.flush()
        return key

    def get_by_hash(self, key_hash: str) -> ApiKey | None:
        return self.session.scalars(select(ApiKey).where(ApiKey.key_hash == key_hash)).first()

    def get_by_prefix(self, prefix: str) -> ApiKey | None:
        return self.session.scalars(select(ApiKey).where(ApiKey.prefix == prefix)).first()

    def list_keys(self, *, include_revoked: bool = False) -> Sequence[ApiKey]:
        query = select(ApiKey).order_by(ApiKey.id)
        if not include_revoked:
            query = query.where(ApiKey.revoked_at.is_(None))
        return self.session.scalars(query).all()

    def revoke(self, key: ApiKey, at: datetime) -> None:
        if key.revoked_at is None:
            key.revoked_at = at
            self.session.flush()

    def usage(self, *, include_revoked: bool = False) -> list[KeyUsage]:
        """Each key with its number of uploads and its last upload's time, oldest key first."""
        uploads = (
            select(
                CalibrationUpload.api_key_id,
                func.count().label("uploads"),
                func.max(CalibrationUpload.received_at).label("last_upload_at"),
            )
            .group_by(CalibrationUpload.api_key_id)
            .subquery()
        )
        query = (
            select(ApiKey, uploads.c.uploads, uploads.c.last_upload_at)
            .outerjoin(uploads, uploads.c.api_key_id == ApiKey.id)
            .order_by(ApiKey.id)
        )
        if not include_revoked:
            query = query.where(ApiKey.revoked_at.is_(None))
        return [
            KeyUsage(
                key=key,
                uploads=count or 0,
                last_upload_at=last,  # (max() keeps its column's type, so its zone)
            )
            for key, count, last in self.session.execute(query)
        ]

    def prefixes(self, ids: Iterable[int]) -> dict[int, str]:
        """The prefix of each key among `ids`."""
        wanted = sorted(set(ids))
        found: dict[int, str] = {}
        for start in range(0, len(wanted), _CHUNK):
            rows = self.session.execute(
                select(ApiKey.id, ApiKey.prefix).where(
                    ApiKey.id.in_(wanted[start : start + _CHUNK])
                )
            )
            found.update({row.id: row.prefix for row in rows})
        return found


@dataclass(frozen=True, slots=True, kw_only=True)
class ObservationRow:
    """What a factor fit needs from one ratio and its upload."""

    model: str
    method: str
    level: Level
    node_id: str
    voter: str  # the prefix of the upload's key
    gpu_name: str
    environment: dict[str, Any]
    outcome: Outcome
    ratio: float


@dataclass(frozen=True, slots=True, kw_only=True)
class RatioGroup:
    """The ratios of one estimator version, method and level (a partition); of one model,
    and of one GPU or environment key of it, where given."""

    estimator_version: str
    method: str
    level: str
    model: str | None = None
    gpu_name: str | None = None
    environment_key: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Change:
    """A change not yet covered by a refit: `model` None for every model of the partition."""

    id: int
    method: str
    level: str
    model: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class PurgedUploads:
    """What deleting a key's uploads deleted."""

    uploads: int
    ratios: int
    # The (estimator version, method, level, model) of the ratios deleted: whose factors
    # are out of date.
    touched: frozenset[tuple[str, str, str, str]]


# Bound parameters per statement when deleting by a list of values (SQLite allows 32,766).
_CHUNK = 1000


class CalibrationRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def find_by_idempotency_key(
        self, api_key_id: int, idempotency_key: str
    ) -> CalibrationUpload | None:
        return self.session.scalars(
            select(CalibrationUpload).where(
                CalibrationUpload.api_key_id == api_key_id,
                CalibrationUpload.idempotency_key == idempotency_key,
            )
        ).first()

    def add_upload(self, upload: CalibrationUpload) -> CalibrationUpload:
        """Insert an upload; DuplicateIdempotencyKeyError if its idempotency key is taken.

        The insert runs in a savepoint, so the caller's transaction survives the conflict and
        can read the upload that won (on PostgreSQL the insert waits until that one commits).
        """
        try:
            with self.session.begin_nested():
                self.session.add(upload)
        except IntegrityError as error:
            existing = (
                self.find_by_idempotency_key(upload.api_key_id, upload.idempotency_key)
                if upload.idempotency_key is not None
                else None
            )
            if existing is None:
                raise
            raise DuplicateIdempotencyKeyError(existing) from error
        return upload

    def add_ratios(self, ratios: Sequence[CalibrationRatio]) -> None:
        self.session.add_all(ratios)
        self.session.flush()

    def set_response(self, upload: CalibrationUpload, response: dict[str, Any]) -> None:
        upload.response = response
        self.session.flush()

    def list_uploads(
        self,
        *,
        limit: int,
        model: str | None = None,
        node_id: str | None = None,
        since: datetime | None = None,
        before_id: int | None = None,
    ) -> Sequence[CalibrationUpload]:
        """Uploads newest first; `before_id` is the keyset cursor of the previous page."""
        query = select(CalibrationUpload).order_by(CalibrationUpload.id.desc()).limit(limit)
        if model is not None:
            query = query.where(CalibrationUpload.model == model)
        if node_id is not None:
            query = query.where(CalibrationUpload.node_id == node_id)
        if since is not None:
            query = query.where(CalibrationUpload.received_at >= since)
        if before_id is not None:
            query = query.where(CalibrationUpload.id < before_id)
        return self.session.scalars(query).all()

    def observations(
        self, estimator_version: str, *, method: str | None = None, level: str | None = None
    ) -> list[ObservationRow]:
        """Every ratio of one estimator version (of one method and level, if given) with its
        group, node and voter, read from its upload and the upload's key (not the ratio's
        copies), for a refit."""
        query = (
            select(
                CalibrationUpload.model,
                CalibrationUpload.method,
                CalibrationRatio.level,
                CalibrationUpload.node_id,
                ApiKey.prefix,
                CalibrationUpload.gpu_name,
                CalibrationUpload.environment,
                CalibrationUpload.outcome,
                CalibrationRatio.ratio,
            )
            .join(CalibrationRatio.upload)
            .join(ApiKey, ApiKey.id == CalibrationUpload.api_key_id)
            .where(CalibrationRatio.estimator_version == estimator_version)
        )
        if method is not None:
            query = query.where(CalibrationUpload.method == method)
        if level is not None:
            query = query.where(CalibrationRatio.level == level)
        rows = self.session.execute(query)
        return [
            ObservationRow(
                model=row.model,
                method=row.method,
                level=row.level,
                node_id=row.node_id,
                voter=row.prefix,
                gpu_name=row.gpu_name,
                environment=row.environment,
                outcome=row.outcome,
                ratio=row.ratio,
            )
            for row in rows
        ]

    def uploads_without_ratios(
        self,
        estimator_version: str,
        *,
        after_id: int = 0,
        through_id: int | None = None,
        limit: int = 500,
    ) -> Sequence[CalibrationUpload]:
        """Uploads with no ratio of `estimator_version` yet, oldest first, after `after_id`
        (and up to `through_id`)."""
        query = (
            select(CalibrationUpload)
            .where(~self._derived(estimator_version), CalibrationUpload.id > after_id)
            .order_by(CalibrationUpload.id)
            .limit(limit)
        )
        if through_id is not None:
            query = query.where(CalibrationUpload.id <= through_id)
        return self.session.scalars(query).all()

    def count_uploads_without_ratios(self, estimator_version: str, *, through_id: int) -> int:
        return (
            self.session.scalar(
                select(func.count())
                .select_from(CalibrationUpload)
                .where(~self._derived(estimator_version), CalibrationUpload.id <= through_id)
            )
            or 0
        )

    @staticmethod
    def _derived(estimator_version: str) -> Any:
        return exists().where(
            CalibrationRatio.upload_id == CalibrationUpload.id,
            CalibrationRatio.estimator_version == estimator_version,
        )

    def mark_changed(self, estimator_version: str, changes: set[tuple[str, str, str]]) -> None:
        """Note that ratios of these (method, level, model) were added: an insert only, so
        that concurrent uploads never wait on one another's row."""
        self.session.add_all(
            CalibrationChange(
                estimator_version=estimator_version, method=method, level=level, model=model
            )
            for method, level, model in sorted(changes)
        )
        self.session.flush()

    def delete_uploads_of_key(self, api_key_id: int) -> PurgedUploads:
        """Delete every upload of one key and the ratios derived from it."""
        of_key = select(CalibrationUpload.id).where(CalibrationUpload.api_key_id == api_key_id)
        ratio = CalibrationRatio
        derived = ratio.upload_id.in_(of_key)
        touched = self.session.execute(
            select(ratio.estimator_version, ratio.method, ratio.level, ratio.model)
            .where(derived)
            .distinct()
        ).all()
        ratios = self.session.scalar(select(func.count()).select_from(ratio).where(derived))
        uploads = self.session.scalar(select(func.count()).select_from(of_key.subquery()))
        # Bulk deletes, the session's copies of the rows left as they are: callers purge in
        # a session of their own.
        unsynchronised = {"synchronize_session": False}
        self.session.execute(delete(ratio).where(derived), execution_options=unsynchronised)
        self.session.execute(
            delete(CalibrationUpload).where(CalibrationUpload.api_key_id == api_key_id),
            execution_options=unsynchronised,
        )
        return PurgedUploads(
            uploads=uploads or 0,
            ratios=ratios or 0,
            touched=frozenset(
                (row.estimator_version, row.method, Level(row.level).value, row.model)
                for row in touched
            ),
        )

    def lock_refit(self, estimator_version: str) -> None:
        """Serialise refits of one version until the transaction ends (PostgreSQL; SQLite
        transactions are serialised already)."""
        if self.session.get_bind().dialect.name == "postgresql":
            self.session.execute(
                text("SELECT pg_advisory_xact_lock(:lock_class, hashtext(:version))"),
                {"lock_class": REFIT_LOCK_CLASS, "version": estimator_version},
            )

    def changes(self, estimator_version: str) -> list[Change]:
        """Each change of one version not yet covered by a refit."""
        rows = self.session.execute(
            select(
                CalibrationChange.id,
                CalibrationChange.method,
                CalibrationChange.level,
                CalibrationChange.model,
            ).where(CalibrationChange.estimator_version == estimator_version)
        )
        return [
            Change(id=row.id, method=row.method, level=row.level, model=row.model) for row in rows
        ]

    def has_changes(self, estimator_version: str) -> bool:
        return (
            self.session.scalar(
                select(CalibrationChange.id)
                .where(CalibrationChange.estimator_version == estimator_version)
                .limit(1)
            )
            is not None
        )

    def forget_changes(self, ids: Sequence[int]) -> None:
        for start in range(0, len(ids), _CHUNK):
            self.session.execute(
                delete(CalibrationChange).where(
                    CalibrationChange.id.in_(ids[start : start + _CHUNK])
                )
            )

    def replace_factors(
        self,
        estimator_version: str,
        method: str,
        level: str,
        models: Sequence[str],
        factors: Sequence[CalibrationFactor],
    ) -> None:
        """The global factor of one partition and the factors of `models` in it, instead of
        those stored."""
        partition = (
            CalibrationFactor.estimator_version == estimator_version,
            CalibrationFactor.method == method,
            CalibrationFactor.level == level,
        )
        self.session.execute(
            delete(CalibrationFactor).where(
                *partition, CalibrationFactor.scope == Scope.GLOBAL.value
            )
        )
        for start in range(0, len(models), _CHUNK):
            self.session.execute(
                delete(CalibrationFactor).where(
                    *partition, CalibrationFactor.model.in_(models[start : start + _CHUNK])
                )
            )
        self.session.add_all(factors)
        self.session.flush()

    # --- A group's runs, as a refit reads them (`service.core.calibration.Runs`) ----------

    @staticmethod
    def _runs(group: RatioGroup, *columns: Any) -> Select[Any]:
        """The ratios of `group`, from their own columns (`ix_calibration_ratio_group`)."""
        ratio = CalibrationRatio
        query = select(*columns).where(
            ratio.estimator_version == group.estimator_version,
            ratio.method == group.method,
            ratio.level == Level(group.level),
        )
        if group.model is not None:
            query = query.where(ratio.model == group.model)
        if group.gpu_name is not None:
            query = query.where(ratio.gpu_name == group.gpu_name)
        if group.environment_key is not None:
            query = query.where(ratio.environment_key == group.environment_key)
        return query

    @staticmethod
    def _selected(query: Select[Any], selection: Selection) -> Select[Any]:
        query = query.where(CalibrationRatio.model.in_(sorted(selection.models)))
        if selection.dropped:
            pair = tuple_(CalibrationRatio.model, CalibrationRatio.voter)
            query = query.where(pair.not_in(sorted(selection.dropped)))
        return query

    def middle_runs(self, group: RatioGroup) -> list[tuple[str, str, float, int]]:
        """The completed runs in the middle of each (model, voter)'s runs of `group`, by
        ratio: one for an odd number of runs, two for an even one (a median's), in one pass
        of the database, not of Python, over the group; each with its pair's number of
        completed runs."""
        pair = (CalibrationRatio.model, CalibrationRatio.voter)
        ranked = (
            self._runs(
                group,
                CalibrationRatio.model,
                CalibrationRatio.voter,
                CalibrationRatio.ratio,
                func.row_number()
                .over(partition_by=pair, order_by=CalibrationRatio.ratio)
                .label("position"),
                func.count().over(partition_by=pair).label("runs"),
            )
            .where(CalibrationRatio.outcome == Outcome.COMPLETED)
            .subquery()
        )
        middle = or_(
            ranked.c.position == (ranked.c.runs + 1) // 2,
            ranked.c.position == ranked.c.runs // 2 + 1,
        )
        query = select(ranked.c.model, ranked.c.voter, ranked.c.ratio, ranked.c.runs).where(middle)
        return [(row.model, row.voter, row.ratio, row.runs) for row in self.session.execute(query)]

    def votes(self, estimator_version: str, method: str, level: str) -> Sequence[CalibrationVote]:
        """Every voter's stored vote per model in one partition."""
        return self.session.scalars(
            select(CalibrationVote).where(
                CalibrationVote.estimator_version == estimator_version,
                CalibrationVote.method == method,
                CalibrationVote.level == level,
            )
        ).all()

    def replace_votes(
        self,
        estimator_version: str,
        method: str,
        level: str,
        models: Sequence[str],
        votes: Sequence[CalibrationVote],
    ) -> None:
        """The votes of `models` in one partition, instead of those stored."""
        for start in range(0, len(models), _CHUNK):
            self.session.execute(
                delete(CalibrationVote).where(
                    CalibrationVote.estimator_version == estimator_version,
                    CalibrationVote.method == method,
                    CalibrationVote.level == level,
                    CalibrationVote.model.in_(models[start : start + _CHUNK]),
                )
            )
        self.session.add_all(votes)
        self.session.flush()

    def count_runs(
        self, group: RatioGroup, selection: Selection, outcome: Outcome, *, above: float | None
    ) -> int:
        """How many runs of `selection` in `group` ended with `outcome` (with a ratio above
        `above`, if given)."""
        query = self._selected(self._runs(group, func.count()), selection).where(
            CalibrationRatio.outcome == outcome
        )
        if above is not None:
            query = query.where(CalibrationRatio.ratio > above)
        return self.session.scalar(query) or 0

    def ranked_ratio(
        self,
        group: RatioGroup,
        selection: Selection,
        rank: int,
        *,
        oom_above: float | None,
        at_most: float | None = None,
    ) -> float:
        """The ratio `rank` others lie above among the completed runs of `selection` (those up
        to `at_most`, if given; and its OOM runs above `oom_above`, if given): a top-k query,
        not a sort in Python."""
        runs = CalibrationRatio.outcome == Outcome.COMPLETED
        if at_most is not None:
            runs = and_(runs, CalibrationRatio.ratio <= at_most)
        if oom_above is not None:
            runs = or_(
                runs,
                and_(CalibrationRatio.outcome == Outcome.OOM, CalibrationRatio.ratio > oom_above),
            )
        query = (
            self._selected(self._runs(group, CalibrationRatio.ratio), selection)
            .where(runs)
            .order_by(CalibrationRatio.ratio.desc())
            .offset(rank)
            .limit(1)
        )
        return float(self.session.execute(query).scalar_one())

    def variants(self, group: RatioGroup) -> tuple[list[str], list[str]]:
        """The GPUs and the environment keys that runs of `group` name."""
        gpus = self._runs(group, CalibrationRatio.gpu_name).distinct()
        keys = self._runs(group, CalibrationRatio.environment_key).distinct()
        return (
            sorted(self.session.scalars(gpus).all()),
            sorted(self.session.scalars(keys).all()),
        )

    def models(self, estimator_version: str, method: str, level: str) -> list[str]:
        """The models of one partition's ratios."""
        group = RatioGroup(estimator_version=estimator_version, method=method, level=level)
        query = self._runs(group, CalibrationRatio.model).distinct()
        return sorted(self.session.scalars(query).all())

    def factors(self, estimator_version: str) -> Sequence[CalibrationFactor]:
        return self.session.scalars(
            select(CalibrationFactor).where(
                CalibrationFactor.estimator_version == estimator_version
            )
        ).all()

    def ratio_count(self, estimator_version: str) -> int:
        return (
            self.session.scalar(
                select(func.count())
                .select_from(CalibrationRatio)
                .where(CalibrationRatio.estimator_version == estimator_version)
            )
            or 0
        )

    def rederivation(self, estimator_version: str) -> CalibrationRederivation | None:
        return self.session.get(CalibrationRederivation, estimator_version)

    def newest_upload_id(self) -> int:
        return self.session.scalar(select(func.max(CalibrationUpload.id))) or 0

    def ratios_after(
        self, estimator_version: str, *, after_id: int, through_upload_id: int, limit: int
    ) -> Sequence[CalibrationRatio]:
        """Ratios of one version with id > after_id whose upload is up to through_upload_id,
        by id, with their uploads."""
        return self.session.scalars(
            select(CalibrationRatio)
            .options(joinedload(CalibrationRatio.upload))
            .where(
                CalibrationRatio.estimator_version == estimator_version,
                CalibrationRatio.id > after_id,
                CalibrationRatio.upload_id <= through_upload_id,
            )
            .order_by(CalibrationRatio.id)
            .limit(limit)
        ).all()
