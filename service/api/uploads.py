"""What the calibration routes do: store an upload once, list uploads, show the factors.

An upload's job is estimated by the same estimator as POST /v1/estimates (`job_estimator`,
which `vramcast db rederive` uses too); the store keeps the raw upload and the ratios.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from pydantic import ValidationError
from sqlalchemy.orm import Session

from service.api.calibration_schemas import (
    MAX_NAME,
    CalibrationFilterIn,
    CalibrationPageOut,
    CalibrationUploadIn,
    FactorTableOut,
    receipt_body,
)
from service.api.estimation import check_config_limits
from service.api.metrics import CUSTOM_MODEL
from service.api.problems import ProblemError, invalid_field
from service.api.schemas import JobSpec, ModelRef
from service.calibration_service import (
    EstimateFn,
    FactorCache,
    NewUpload,
    Submission,
    list_calibrations,
    submit_upload,
)
from service.catalog.gpus import GpuCatalog, UnknownGpuError
from service.catalog.models import ModelCatalog
from service.core.architecture import ModelArch, from_hf_config
from service.core.errors import InvalidSpecError, UnknownModelError
from service.core.estimator import ESTIMATOR_VERSION, estimate
from service.core.result import Estimate
from service.store.models import ApiKey

_JOB_LOC = ("body", "job")


@dataclass(frozen=True, slots=True, kw_only=True)
class Calibrations:
    """The services the calibration routes use."""

    models: ModelCatalog
    gpus: GpuCatalog
    cache: FactorCache

    def submit(
        self,
        session: Session,
        body: CalibrationUploadIn,
        *,
        key: ApiKey,
        idempotency_key: str | None,
    ) -> Submission:
        """Store the upload and its ratios and commit, or replay the first answer."""
        upload = self.new_upload(body)
        submission = submit_upload(
            session,
            upload,
            api_key_id=key.id,
            idempotency_key=idempotency_key,
            estimate=job_estimator(self.models),
            factors=self.cache.peek().table,
            render=partial(receipt_body, upload.model),
        )
        session.commit()
        if not submission.replayed:
            self.cache.invalidate()
        return submission

    def new_upload(self, body: CalibrationUploadIn) -> NewUpload:
        return NewUpload(
            job=body.job.model_dump(mode="json", exclude_unset=True),
            model=self.model_id(body.job.model),
            method=body.job.method.value,
            gpu_name=self.gpu_name(body.gpu.name),
            gpu_memory_total_bytes=body.gpu.memory_total_bytes,
            measured=body.measured.to_core(),
            outcome=body.outcome,
            environment=body.environment.model_dump(mode="json", exclude_unset=True),
            node_id=body.node_id,
            run_id=body.run_id,
        )

    def model_id(self, ref: ModelRef) -> str:
        """The model an upload calibrates, named as estimates name it: the catalog id, the id
        as sent when the catalog does not know it (yet), or `hf_config`."""
        if ref.id is None:
            return CUSTOM_MODEL
        name = self.catalog_id(ref.id)
        if len(name) > MAX_NAME:
            detail = f"a model the catalog does not know needs an id of at most {MAX_NAME}"
            loc = (*_JOB_LOC, "model", "id")
            raise ProblemError(invalid_field(loc, detail, "string_too_long"))
        return name

    def catalog_id(self, model: str) -> str:
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

    def page(self, session: Session, filters: CalibrationFilterIn) -> CalibrationPageOut:
        found = list_calibrations(
            session,
            limit=filters.limit,
            model=None if filters.model is None else self.catalog_id(filters.model),
            node_id=filters.node_id,
            since=filters.since,
            cursor=filters.cursor,
        )
        return CalibrationPageOut.from_core(found)

    def factors(self) -> FactorTableOut:
        snapshot = self.cache.peek()
        return FactorTableOut.from_core(
            state=snapshot.state,
            age_s=self.cache.age_s(snapshot),
            error=snapshot.error,
            estimator_version=ESTIMATOR_VERSION,
            table=snapshot.table,
        )


def job_estimator(models: ModelCatalog) -> EstimateFn:
    """The estimate of a job as an upload stores it (the JSON of POST /v1/estimates).

    Estimator errors propagate (the store keeps the upload without ratios); a stored job that
    no longer validates is an invalid spec, so a re-derivation passes over it.
    """

    def estimate_job(job: Mapping[str, Any]) -> Estimate:
        try:
            spec = JobSpec.model_validate(job)
        except ValidationError as error:
            raise InvalidSpecError("job", str(error.errors()[0]["msg"])) from error
        return estimate(_architecture(models, spec.model), spec.to_spec())

    return estimate_job


def _architecture(models: ModelCatalog, ref: ModelRef) -> ModelArch:
    if ref.id is not None:
        return models.resolve(ref.id).arch
    arch = from_hf_config(ref.hf_config or {})
    check_config_limits(arch, (*_JOB_LOC, "model", "hf_config"))
    return arch
