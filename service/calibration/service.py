"""The calibration services the API uses: store an upload once, list uploads, the factors.

Uploads and listings name models and GPUs as estimates name them (the catalogs' names);
a name the catalogs do not know (yet) is kept as sent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from service.calibration.factors import FactorCache
from service.calibration.uploads import (
    CalibrationPage,
    EstimateFn,
    NewUpload,
    Revocation,
    Submission,
    UploadReceipt,
    list_calibrations,
    revoke,
    submit_upload,
)
from service.catalog.gpus import GpuCatalog, UnknownGpuError
from service.catalog.models import ModelCatalog
from service.core.errors import UnknownModelError
from service.core.estimator import ESTIMATOR_VERSION
from service.store.keys import key_usage
from service.store.repositories import KeyUsage


@dataclass(frozen=True, slots=True, kw_only=True)
class Calibrations:
    """The catalogs that name an upload's model and GPU, and this replica's factors."""

    models: ModelCatalog
    gpus: GpuCatalog
    cache: FactorCache

    def submit(
        self,
        session: Session,
        upload: NewUpload,
        *,
        api_key_id: int,
        idempotency_key: str | None,
        estimate: EstimateFn,
        render: Callable[[UploadReceipt], dict[str, Any]],
    ) -> Submission:
        """Store the upload and its ratios and commit, or replay the first answer."""
        submission = submit_upload(
            session,
            upload,
            api_key_id=api_key_id,
            idempotency_key=idempotency_key,
            estimate=estimate,
            factors=self.cache.peek().table,
            render=render,
        )
        session.commit()
        if not submission.replayed:
            self.cache.invalidate()
        return submission

    def catalog_id(self, model: str) -> str:
        """The catalog's id for a model, or the id as sent when the catalog does not know it."""
        try:
            return self.models.resolve(model).id
        except UnknownModelError:
            return model

    def gpu_name(self, reported: str) -> str:
        """The catalog's name for a GPU (as estimates name it), or the name as reported."""
        try:
            return self.gpus.resolve(reported).name
        except UnknownGpuError:
            return reported

    def page(
        self,
        session: Session,
        *,
        limit: int,
        model: str | None,
        node_id: str | None,
        since: datetime | None,
        cursor: str | None,
    ) -> CalibrationPage:
        """A page of uploads, newest first, of one model named as the catalog names it."""
        return list_calibrations(
            session,
            limit=limit,
            model=None if model is None else self.catalog_id(model),
            node_id=node_id,
            since=since,
            cursor=cursor,
        )

    def keys(self, session: Session, *, include_revoked: bool) -> list[KeyUsage]:
        """Every live key (and the revoked ones, if asked) with its uploads."""
        return key_usage(session, include_revoked=include_revoked)

    def revoke(
        self, session: Session, prefix: str, *, purge: bool, now: datetime
    ) -> Revocation | None:
        """Revoke a key and, with `purge`, delete its uploads and refit this estimator's
        factors without them; commit, and reload this replica's factors (the others within
        their TTL). None when no key has the prefix."""
        revocation = revoke(
            session, prefix, purge=purge, estimator_version=ESTIMATOR_VERSION, now=now
        )
        session.commit()
        if revocation is not None and revocation.purge is not None:
            self.cache.invalidate()
        return revocation
