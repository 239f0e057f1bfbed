"""The calibration factors this replica applies."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from service.api.calibration_schemas import FactorTableOut
from service.api.deps import CalibrationsDep
from service.api.problems import responses
from service.api.responses import json_response

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
    return json_response(calibrations.factors())
