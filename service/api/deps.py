"""What routes depend on, as `Annotated` aliases over the services the app factory builds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy import Engine

from service.api.calibration import FactorProvider
from service.api.estimation import Estimation
from service.api.metrics import Metrics
from service.api.settings import Settings
from service.catalog.gpus import GpuCatalog
from service.catalog.models import ModelCatalog


@dataclass(frozen=True, slots=True, kw_only=True)
class Services:
    """Built once per app by `create_app`, kept on `app.state.services`."""

    settings: Settings
    models: ModelCatalog
    gpus: GpuCatalog
    factors: FactorProvider
    metrics: Metrics
    engine: Engine


def _services(request: Request) -> Services:
    services: Services = request.app.state.services
    return services


# Dependencies are coroutines so that FastAPI calls them inline, not in its thread pool.
async def get_settings(request: Request) -> Settings:
    return _services(request).settings


async def get_model_catalog(request: Request) -> ModelCatalog:
    return _services(request).models


async def get_gpu_catalog(request: Request) -> GpuCatalog:
    return _services(request).gpus


async def get_factor_provider(request: Request) -> FactorProvider:
    return _services(request).factors


async def get_metrics(request: Request) -> Metrics:
    return _services(request).metrics


async def get_engine(request: Request) -> Engine:
    return _services(request).engine


SettingsDep = Annotated[Settings, Depends(get_settings)]
ModelCatalogDep = Annotated[ModelCatalog, Depends(get_model_catalog)]
GpuCatalogDep = Annotated[GpuCatalog, Depends(get_gpu_catalog)]
FactorProviderDep = Annotated[FactorProvider, Depends(get_factor_provider)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
EngineDep = Annotated[Engine, Depends(get_engine)]


async def get_estimation(
    models: ModelCatalogDep,
    gpus: GpuCatalogDep,
    factors: FactorProviderDep,
    metrics: MetricsDep,
) -> Estimation:
    return Estimation(models=models, gpus=gpus, factors=factors, metrics=metrics)


EstimationDep = Annotated[Estimation, Depends(get_estimation)]
