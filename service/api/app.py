"""The app factory: `create_app(settings)` builds an isolated FastAPI app.

Run with `vramcast serve`, or `uvicorn service.api.app:create_app --factory`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.openapi.utils import get_openapi

from service.api import problems
from service.api.access import AccessMiddleware, configure_access_log
from service.api.answers import AnswerCache
from service.api.auth import KeyCache
from service.api.body import DOCUMENTED_BODIES
from service.api.budget import ColdWork
from service.api.deps import Services, require_read_key
from service.api.docs import mount_docs
from service.api.limits import BodyLimitMiddleware
from service.api.manual import mount_manual
from service.api.metrics import Metrics, MetricsMiddleware
from service.api.routes import calibrations, catalog, estimates, factors, fit_checks, health, keys
from service.api.settings import Settings
from service.calibration.factors import FactorCache, factor_loader, keep_fresh
from service.calibration.provider import CachedFactors, FactorProvider
from service.catalog.gpus import default_gpu_catalog
from service.catalog.models import default_catalog
from service.core.estimator import ESTIMATOR_VERSION
from service.store.db import StoreTimeouts, create_engine_from_url, create_session_factory
from service.web import mount_web

TITLE = "vramcast"
DESCRIPTION = (
    "Peak GPU memory of full, LoRA and QLoRA fine-tuning jobs, before they are placed. "
    "Every size is in bytes; errors are RFC 9457 problem details (application/problem+json)."
)


def _version() -> str:
    try:
        return version("vramcast")
    except PackageNotFoundError:
        return "0.0.0"


def create_app(
    settings: Settings | None = None, *, factor_provider: FactorProvider | None = None
) -> FastAPI:
    """A new app; `factor_provider` replaces the store's factors (a seam for tests)."""
    settings = settings or Settings()
    metrics = Metrics()
    engine = create_engine_from_url(
        settings.database_url, timeouts=StoreTimeouts(answer_s=settings.store_timeout_s)
    )
    sessions = create_session_factory(engine)
    cache = FactorCache(factor_loader(sessions, ESTIMATOR_VERSION))
    key_cache = KeyCache()
    services = Services(
        settings=settings,
        models=default_catalog(),
        gpus=default_gpu_catalog(),
        factors=factor_provider or CachedFactors(cache),
        metrics=metrics,
        engine=engine,
        sessions=sessions,
        factor_cache=cache,
        answers=AnswerCache(settings.estimate_cache_entries),
        keys=key_cache,
        cold_work=ColdWork(settings, metrics, sessions, key_cache),
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        # The first factors are loaded before the first request; requests never load them.
        await asyncio.to_thread(cache.get)
        _freeze_startup_heap()
        refresher = asyncio.create_task(keep_fresh(cache))
        try:
            yield
        finally:
            refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await refresher
            engine.dispose()

    configure_access_log()
    # FastAPI's own /docs and /redoc load their assets from a CDN: `mount_docs` serves them.
    app = FastAPI(
        title=TITLE,
        description=DESCRIPTION,
        version=_version(),
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        # A body without a content type is read as JSON on every route, as POST /v1/estimates
        # reads it; one with another content type is refused with 415 (`body.require_json`).
        strict_content_type=False,
    )
    app.state.services = services
    reads = [Depends(require_read_key)] if settings.require_read_key else []
    # Routes are matched in order: probes and estimates, the most frequent requests, first.
    app.include_router(health.router)
    app.include_router(estimates.router)
    app.include_router(fit_checks.router)
    app.include_router(calibrations.router)
    app.include_router(keys.router)
    app.include_router(calibrations.reads, dependencies=reads)
    app.include_router(factors.router, dependencies=reads)
    app.include_router(catalog.router)
    mount_docs(app)
    mount_web(app)
    mount_manual(app, settings.manual_dir)
    problems.install(app)
    # The last added is the outermost: metrics see every answer, 413s included, and every
    # answer carries its request id and is logged. Innermost, estimates skip the router.
    app.add_middleware(
        estimates.EstimateShortcut,
        route=estimates.estimate_route(),
        handlers=app.exception_handlers,
    )
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    app.add_middleware(AccessMiddleware)
    app.openapi = _openapi(app)  # type: ignore[method-assign]
    return app


_heap_frozen = False


def _freeze_startup_heap() -> None:
    """Once per process, when its first app has started: what start-up built (modules,
    catalogs, schemas, the first factors) leaves the garbage collector's generations, so
    that the collections that a request's many short-lived objects set off stop scanning
    it again and again (`gc.freeze`; measured in process: about half of the time a 1000-job
    batch took to parse)."""
    global _heap_frozen
    if not _heap_frozen:
        _heap_frozen = True
        gc.collect()
        gc.freeze()


def _openapi(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """FastAPI's schema plus the Problem schema that `problems.responses` refers to."""

    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            problem = problems.Problem.model_json_schema(
                ref_template="#/components/schemas/{model}", mode="serialization"
            )
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name, definition in problem.pop("$defs", {}).items():
                components.setdefault(name, definition)
            components.setdefault("Problem", problem)
            # Bodies the routes read themselves, documented as declared bodies would be.
            for name, model in DOCUMENTED_BODIES.items():
                if name in components:
                    continue
                body = model.model_json_schema(
                    ref_template="#/components/schemas/{model}", mode="validation"
                )
                for sub, definition in body.pop("$defs", {}).items():
                    components.setdefault(sub, definition)
                components[name] = body
            app.openapi_schema = schema
        return app.openapi_schema

    return build
