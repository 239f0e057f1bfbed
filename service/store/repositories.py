"""All SQL of the store. Repositories flush and never commit: the caller's unit of work does."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import exists, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.core.calibration import Level, Outcome
from service.store.models import ApiKey, CalibrationRatio, CalibrationUpload


class DuplicateIdempotencyKeyError(Exception):
    """Another upload already holds this (API key, Idempotency-Key) pair: `existing`."""

    def __init__(self, existing: CalibrationUpload) -> None:
        super().__init__(f"Idempotency-Key {existing.idempotency_key!r} is already used")
        self.existing = existing


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


@dataclass(frozen=True, slots=True, kw_only=True)
class ObservationRow:
    """What a factor fit needs from one ratio and its upload."""

    model: str
    method: str
    level: Level
    node_id: str
    gpu_name: str
    environment: dict[str, Any]
    outcome: Outcome
    ratio: float


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

    def observations(self, estimator_version: str) -> list[ObservationRow]:
        """Every ratio of one estimator version with its group and node, for a refit."""
        rows = self.session.execute(
            select(
                CalibrationUpload.model,
                CalibrationUpload.method,
                CalibrationRatio.level,
                CalibrationUpload.node_id,
                CalibrationUpload.gpu_name,
                CalibrationUpload.environment,
                CalibrationUpload.outcome,
                CalibrationRatio.ratio,
            )
            .join(CalibrationRatio.upload)
            .where(CalibrationRatio.estimator_version == estimator_version)
        )
        return [
            ObservationRow(
                model=row.model,
                method=row.method,
                level=row.level,
                node_id=row.node_id,
                gpu_name=row.gpu_name,
                environment=row.environment,
                outcome=row.outcome,
                ratio=row.ratio,
            )
            for row in rows
        ]

    def uploads_without_ratios(
        self, estimator_version: str, *, after_id: int = 0, limit: int = 500
    ) -> Sequence[CalibrationUpload]:
        """Uploads with no ratio of `estimator_version` yet, oldest first, after `after_id`."""
        derived = exists().where(
            CalibrationRatio.upload_id == CalibrationUpload.id,
            CalibrationRatio.estimator_version == estimator_version,
        )
        return self.session.scalars(
            select(CalibrationUpload)
            .where(~derived, CalibrationUpload.id > after_id)
            .order_by(CalibrationUpload.id)
            .limit(limit)
        ).all()
