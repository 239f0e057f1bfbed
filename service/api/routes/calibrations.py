"""Calibration uploads from training nodes, and their listing."""

from __future__ import annotations

import json
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query
from fastapi.responses import Response

from service.api import uploads
from service.api.body import require_json
from service.api.deps import CalibrationsDep, SessionDep, UploadKeyDep
from service.api.problems import responses
from service.api.responses import json_response
from service.api.schemas.calibrations import (
    CalibrationFilterIn,
    CalibrationPageOut,
    CalibrationReceiptOut,
    CalibrationUploadIn,
)
from service.calibration.uploads import Submission

router = APIRouter(prefix="/v1", tags=["calibrations"])
# Reads: the app adds a read-key dependency when the service requires one.
reads = APIRouter(prefix="/v1", tags=["calibrations"])

REPLAYED_HEADER = "Idempotent-Replayed"

IdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        min_length=1,
        max_length=255,
        pattern=r"^[\x21-\x7e]+$",
        description="Any unique string per upload (a UUID); a retry with the same key and body "
        "is answered with the first answer and stored once.",
    ),
]


@router.post(
    "/calibrations",
    status_code=201,
    response_model=CalibrationReceiptOut,
    summary="Upload a measured peak",
    description="A training node's measured peaks for a job (needs a key with the upload "
    "scope). The raw upload is stored, the job estimated, measured / estimated recorded per "
    "level, and the factors refit; every replica applies them within 10 s.",
    responses={
        200: {
            "model": CalibrationReceiptOut,
            "description": f"A replay of an earlier upload (header `{REPLAYED_HEADER}: true`).",
        },
        **responses(401, 403, 413, 415, 422, 503),
    },
    dependencies=[Depends(require_json)],
)
def create_calibration(
    body: CalibrationUploadIn,
    key: UploadKeyDep,
    session: SessionDep,
    calibrations: CalibrationsDep,
    idempotency_key: IdempotencyKey = None,
) -> Response:
    submission = uploads.submit(
        calibrations, session, body, key=key, idempotency_key=idempotency_key
    )
    return _answer(submission)


@reads.get(
    "/calibrations",
    response_model=CalibrationPageOut,
    summary="List calibration uploads",
    description="Uploads newest first, as sent, with their ratios; filter by model, node or "
    "time, and page on with `cursor`. Needs a read key when the service requires one.",
    responses=responses(401, 403, 422, 503),
)
def list_calibrations(
    filters: Annotated[CalibrationFilterIn, Query()],
    session: SessionDep,
    calibrations: CalibrationsDep,
) -> Response:
    page = calibrations.page(
        session,
        limit=filters.limit,
        model=filters.model,
        node_id=filters.node_id,
        since=filters.since,
        cursor=filters.cursor,
    )
    return json_response(CalibrationPageOut.from_core(page))


def _answer(submission: Submission) -> Response:
    body = json.dumps(submission.body, separators=(",", ":")).encode()
    if submission.replayed:
        return Response(
            body, status_code=200, media_type="application/json", headers={REPLAYED_HEADER: "true"}
        )
    return Response(body, status_code=201, media_type="application/json")
