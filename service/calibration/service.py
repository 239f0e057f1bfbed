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
    Submission,
    UploadReceipt,
    list_calibrations,
    submit_upload,
)
from service.catalog.gpus import GpuCatalog, UnknownGpuError
from service.catalog.models import ModelCatalog
from service.core.errors import UnknownModelError


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
