"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from service.api.deps import EngineDep, GpuCatalogDep, MetricsDep, ModelCatalogDep
from service.api.responses import json_response
from service.api.schemas import HealthOut

router = APIRouter(tags=["operations"])

PROMETHEUS_MEDIA_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@router.get(
    "/livez",
    response_model=HealthOut,
    summary="Liveness: the process answers",
    description="Always 200 while the process serves requests.",
)
async def livez() -> Response:
    return json_response(HealthOut(status="ok", checks={}))


@router.get(
    "/readyz",
    response_model=HealthOut,
    summary="Readiness: catalogs loaded and the store reachable",
    description="200 when every check passes, 503 (with the failing checks) otherwise.",
    responses={503: {"model": HealthOut, "description": "A check failed."}},
)
def readyz(models: ModelCatalogDep, gpus: GpuCatalogDep, engine: EngineDep) -> Response:
    checks = {
        "models": bool(models.entries()),
        "gpus": bool(gpus.gpus()),
        "database": _database_answers(engine),
    }
    ready = all(checks.values())
    body = HealthOut(status="ok" if ready else "unavailable", checks=checks)
    return json_response(body, status_code=200 if ready else 503)


@router.get(
    "/metrics",
    summary="Prometheus metrics",
    description="Requests and latency per route, estimates per model (text exposition format).",
    response_class=Response,
    responses={200: {"content": {PROMETHEUS_MEDIA_TYPE: {"schema": {"type": "string"}}}}},
)
async def metrics(registry: MetricsDep) -> Response:
    return Response(registry.exposition(), media_type=PROMETHEUS_MEDIA_TYPE)


def _database_answers(engine: EngineDep) -> bool:
    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
    except SQLAlchemyError:
        return False
    return True
