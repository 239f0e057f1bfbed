"""The calibration factors this replica applies."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from service.api.deps import CalibrationsDep
from service.api.problems import responses
from service.api.responses import json_response
from service.api.schemas.calibrations import FactorTableOut
from service.core.estimator import ESTIMATOR_VERSION

# A read: the app adds a read-key dependency when the service requires one.
router = APIRouter(prefix="/v1", tags=["calibrations"])


@router.get(
    "/factors",
    response_model=FactorTableOut,
    summary="The calibration factors in use",
    description="Every group's factor as this replica caches it, and whether the cache is "
    "fresh, stale (the store is unreachable) or empty. Answers while the store is down; needs "
    "a read key when the service requires one.",
    responses=responses(401, 403, 503),
)
async def get_factors(calibrations: CalibrationsDep) -> Response:
    cache = calibrations.cache
    snapshot = cache.peek()
    return json_response(
        FactorTableOut.from_core(
            snapshot, age_s=cache.age_s(snapshot), estimator_version=ESTIMATOR_VERSION
        )
    )
