"""What routes depend on, as `Annotated` aliases over the services the app factory builds."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from service.api.answers import AnswerCache
from service.api.auth import KeyCache, api_key, require_cached_key, require_key
from service.api.budget import ColdWork
from service.api.estimation import Estimation
from service.api.metrics import Metrics
from service.api.settings import Settings
from service.calibration.factors import FactorCache
from service.calibration.provider import FactorProvider
from service.calibration.service import Calibrations
from service.catalog.gpus import GpuCatalog
from service.catalog.models import ModelCatalog
from service.store.keys import KeyScope
from service.store.models import ApiKey


@dataclass(frozen=True, slots=True, kw_only=True)
class Services:
    """Built once per app by `create_app`, kept on `app.state.services`."""

    settings: Settings
    models: ModelCatalog
    gpus: GpuCatalog
    factors: FactorProvider
    metrics: Metrics
    engine: Engine
    sessions: sessionmaker[Session]
    factor_cache: FactorCache
    answers: AnswerCache
    keys: KeyCache  # read keys the store verified lately (`auth.KeyCache`)
    cold_work: ColdWork  # slots and time for estimates' and fit-checks' cold work


def services_of(request: Request) -> Services:
    """The services of the request's app."""
    services: Services = request.app.state.services
    return services


# Dependencies are coroutines so that FastAPI calls them inline, not in its thread pool.
async def get_model_catalog(request: Request) -> ModelCatalog:
    return services_of(request).models


async def get_gpu_catalog(request: Request) -> GpuCatalog:
    return services_of(request).gpus


async def get_metrics(request: Request) -> Metrics:
    return services_of(request).metrics


async def get_engine(request: Request) -> Engine:
    return services_of(request).engine


def get_session(request: Request) -> Iterator[Session]:
    """One session per request; the route commits (once, before its 201) or nothing is kept."""
    with services_of(request).sessions() as session:
        yield session


ModelCatalogDep = Annotated[ModelCatalog, Depends(get_model_catalog)]
GpuCatalogDep = Annotated[GpuCatalog, Depends(get_gpu_catalog)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
EngineDep = Annotated[Engine, Depends(get_engine)]
SessionDep = Annotated[Session, Depends(get_session)]
CredentialsDep = Annotated[HTTPAuthorizationCredentials | None, Depends(api_key)]


async def get_estimation(request: Request) -> Estimation:
    # One dependency rather than one per service: FastAPI resolves every dependency on every
    # request, and these services are fixed for the app's life (the factor provider included).
    return estimation_for(services_of(request))


def estimation_for(services: Services) -> Estimation:
    """What one request's estimates use, from the app's services."""
    return Estimation(
        models=services.models,
        gpus=services.gpus,
        factors=services.factors,
        metrics=services.metrics,
    )


EstimationDep = Annotated[Estimation, Depends(get_estimation)]


def get_upload_key(session: SessionDep, credentials: CredentialsDep) -> ApiKey:
    return require_key(session, credentials, KeyScope.UPLOAD)


def require_read_key(request: Request, session: SessionDep, credentials: CredentialsDep) -> None:
    """On the read routes when the service requires a read key (`require_read_key`): through
    the app's key cache, so that GET /v1/factors answers while the store is down."""
    require_cached_key(services_of(request).keys, session, credentials, KeyScope.READ)


def get_admin_key(session: SessionDep, credentials: CredentialsDep) -> ApiKey:
    return require_key(session, credentials, KeyScope.ADMIN)


UploadKeyDep = Annotated[ApiKey, Depends(get_upload_key)]
AdminKeyDep = Annotated[ApiKey, Depends(get_admin_key)]


async def get_calibrations(request: Request) -> Calibrations:
    services = services_of(request)
    return Calibrations(models=services.models, gpus=services.gpus, cache=services.factor_cache)


CalibrationsDep = Annotated[Calibrations, Depends(get_calibrations)]
