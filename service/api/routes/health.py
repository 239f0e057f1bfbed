"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

import asyncio
import weakref
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import Response
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from service.api.deps import MetricsDep, services_of
from service.api.responses import json_response
from service.api.schemas import HealthOut, ReadinessOut
from service.store.db import write_check

router = APIRouter(tags=["operations"])

PROMETHEUS_MEDIA_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Seconds /readyz waits for its store check: a probe gets its answer within 2 s even when the
# database hangs (the check itself goes on, bounded by the store's own timeouts).
READY_CHECK_S = 1.5


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
    response_model=ReadinessOut,
    summary="Readiness: catalogs, the store (reachable, taking writes), the factors",
    description="200 when every check passes, 503 with the failing checks and why otherwise: "
    "`database` (the store answers), `writes` (it would take an upload: not read-only, not "
    "full), `factors` (this replica loaded the factor table at least once). Answers within "
    "2 s.",
    responses={503: {"model": ReadinessOut, "description": "A check failed."}},
)
async def readyz(request: Request) -> Response:
    services = services_of(request)
    store = await _store_state(services.engine)
    checks = {
        "models": bool(services.models.entries()),
        "gpus": bool(services.gpus.gpus()),
        "database": store.reachable,
        "writes": store.reachable and store.refusal is None,
        "factors": services.factor_cache.peek().loaded_at is not None,
    }
    reasons = {}
    if not store.reachable:
        reasons["database"] = store.detail
    elif store.refusal is not None:
        reasons["writes"] = store.refusal
    if not checks["factors"]:
        reasons["factors"] = "this replica has not loaded the factor table yet"
    ready = all(checks.values())
    body = ReadinessOut(status="ok" if ready else "unavailable", checks=checks, reasons=reasons)
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


@dataclass(frozen=True, slots=True)
class StoreState:
    reachable: bool
    refusal: str | None  # why a write would be refused, if it would
    detail: str = ""  # why it is not reachable


# The check in flight per engine: concurrent probes share it, and a hung database holds one
# worker thread, not one per probe.
_checks: weakref.WeakKeyDictionary[Engine, asyncio.Future[StoreState]] = weakref.WeakKeyDictionary()


async def _store_state(engine: Engine) -> StoreState:
    running = _checks.get(engine)
    if running is None or running.done() or running.get_loop() is not asyncio.get_running_loop():
        running = _checks[engine] = asyncio.ensure_future(asyncio.to_thread(_check_store, engine))
    try:
        return await asyncio.wait_for(asyncio.shield(running), READY_CHECK_S)
    except TimeoutError:
        return StoreState(
            reachable=False,
            refusal=None,
            detail=f"the database did not answer within {READY_CHECK_S:g} s",
        )


def _check_store(engine: Engine) -> StoreState:
    try:
        with engine.connect() as connection:
            refusal = write_check(connection)
    except SQLAlchemyError as error:
        return StoreState(
            reachable=False, refusal=None, detail=f"the database cannot be reached: {_kind(error)}"
        )
    return StoreState(reachable=True, refusal=refusal)


def _kind(error: SQLAlchemyError) -> str:
    original = getattr(error, "orig", None)
    return type(original if original is not None else error).__name__
