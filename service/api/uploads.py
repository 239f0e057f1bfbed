"""An upload's body as the calibration package takes it: its names, its job's estimate.

An upload's job is estimated by the same estimator as POST /v1/estimates; `job_estimator`
estimates a stored job (`vramcast db rederive` uses it too).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

from pydantic import ValidationError
from sqlalchemy.orm import Session

from service.api.estimation import resolve_model
from service.api.metrics import CUSTOM_MODEL
from service.api.problems import ProblemError, invalid_field
from service.api.schemas.calibrations import MAX_NAME, CalibrationUploadIn, receipt_body
from service.api.schemas.jobs import JobSpec, ModelRef
from service.calibration.service import Calibrations
from service.calibration.uploads import EstimateFn, Submission
from service.catalog.models import ModelCatalog
from service.core.errors import InvalidSpecError
from service.core.estimator import estimate
from service.core.result import Estimate
from service.store.models import ApiKey

_JOB_LOC = ("body", "job")


def submit(
    calibrations: Calibrations,
    session: Session,
    body: CalibrationUploadIn,
    *,
    key: ApiKey,
    idempotency_key: str | None,
) -> Submission:
    """Store the upload and its ratios and commit, or replay the first answer."""
    upload = body.to_upload(
        model=upload_model(calibrations, body.job.model),
        gpu_name=calibrations.gpu_name(body.gpu.name),
    )

    def estimate_body(_stored: Mapping[str, Any]) -> Estimate:
        # The stored job is this body's: its validated spec is estimated as it is.
        return estimate_job(calibrations.models, body.job)

    return calibrations.submit(
        session,
        upload,
        api_key_id=key.id,
        idempotency_key=idempotency_key,
        estimate=estimate_body,
        render=partial(receipt_body, upload.model),
    )


def upload_model(calibrations: Calibrations, ref: ModelRef) -> str:
    """The model an upload calibrates, named as estimates name it: the catalog id, the id
    as sent when the catalog does not know it (yet), or `hf_config`."""
    if ref.id is None:
        return CUSTOM_MODEL
    name = calibrations.catalog_id(ref.id)
    if len(name) > MAX_NAME:
        detail = f"a model the catalog does not know needs an id of at most {MAX_NAME}"
        loc = (*_JOB_LOC, "model", "id")
        raise ProblemError(invalid_field(loc, detail, "string_too_long"))
    return name


def estimate_job(models: ModelCatalog, job: JobSpec) -> Estimate:
    """The estimate of an upload's job, as POST /v1/estimates makes it (without a GPU)."""
    _, arch = resolve_model(job.model, _JOB_LOC, models.resolve)
    return estimate(arch, job.to_spec())


def job_estimator(models: ModelCatalog) -> EstimateFn:
    """The estimate of a job as an upload stores it (the JSON of POST /v1/estimates).

    Estimator errors propagate (the store keeps the upload without ratios); a stored job that
    no longer validates is an invalid spec, so a re-derivation passes over it.
    """

    def estimate_stored(job: Mapping[str, Any]) -> Estimate:
        try:
            spec = JobSpec.model_validate(job)
        except ValidationError as error:
            raise InvalidSpecError("job", str(error.errors()[0]["msg"])) from error
        return estimate_job(models, spec)

    return estimate_stored
