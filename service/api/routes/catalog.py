"""The catalogs: models the service knows by id, and GPUs by name and reported memory."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path
from fastapi.responses import Response

from service.api.deps import GpuCatalogDep, ModelCatalogDep
from service.api.problems import responses
from service.api.responses import json_response
from service.api.schemas import GpuListOut, ModelListOut, ModelOut

router = APIRouter(prefix="/v1", tags=["catalog"])


@router.get(
    "/models",
    response_model=ModelListOut,
    summary="List the catalog's models",
    description="Every model id the estimator resolves, with aliases and parameter totals.",
)
async def list_models(models: ModelCatalogDep) -> Response:
    return json_response(ModelListOut.from_catalog(models))


@router.get(
    "/models/{model_id:path}",
    response_model=ModelOut,
    summary="A model's architecture and parameter counts",
    description="Resolves ids like /v1/models lists them, case-insensitively, with or without "
    "the organisation; a fine-tuned '-Instruct' id resolves to its base architecture.",
    responses=responses(404, 422),
)
async def get_model(
    model_id: Annotated[str, Path(max_length=256, description="A catalog model id.")],
    models: ModelCatalogDep,
) -> Response:
    return json_response(ModelOut.from_core(models.resolve(model_id)))


@router.get(
    "/gpus",
    response_model=GpuListOut,
    summary="List the catalog's GPUs",
    description="Names, nvidia-smi names, memory as the driver reports it, bf16 and fp8.",
)
async def list_gpus(gpus: GpuCatalogDep) -> Response:
    return json_response(GpuListOut.from_catalog(gpus))
