"""Bodies of the catalog and health routes."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from service.api.schemas.base import Bytes, Out
from service.catalog.gpus import GpuCatalog
from service.catalog.models import CatalogEntry, ModelCatalog
from service.core.fit import usable_bytes


class ModelSummaryOut(Out):
    id: str = Field(max_length=256, description="Catalog id (a Hugging Face Hub id).")
    aliases: list[str] = Field(max_length=64, description="Other ids that resolve to it.")
    model_type: str = Field(max_length=64, description="config.json model_type.")
    total_params: int = Field(ge=0, description="Parameters, counted from the architecture.")


class ModelListOut(Out):
    models: list[ModelSummaryOut] = Field(max_length=10_000, description="Catalog models.")

    @classmethod
    def from_catalog(cls, catalog: ModelCatalog) -> ModelListOut:
        return cls(
            models=[
                ModelSummaryOut(
                    id=entry.id,
                    aliases=list(entry.aliases),
                    model_type=entry.arch.model_type,
                    total_params=entry.arch.total_params,
                )
                for entry in catalog.entries()
            ]
        )


class ArchitectureOut(Out):
    """The config.json values the estimator reads."""

    model_type: str = Field(max_length=64, description="config.json model_type.")
    hidden_size: int = Field(ge=1, description="Width of the residual stream.")
    num_hidden_layers: int = Field(ge=1, description="Decoder layers.")
    num_attention_heads: int = Field(ge=1, description="Query heads.")
    num_key_value_heads: int = Field(ge=1, description="Key/value heads (GQA).")
    head_dim: int = Field(ge=1, description="Width of one head.")
    intermediate_size: int = Field(ge=0, description="MLP width.")
    vocab_size: int = Field(ge=1, description="Vocabulary size.")
    max_position_embeddings: int = Field(ge=0, description="Longest trained context.")
    tie_word_embeddings: bool = Field(description="lm_head shares the embedding.")
    num_experts: int = Field(ge=0, description="MoE experts per layer; 0: dense.")
    num_experts_per_tok: int = Field(ge=0, description="Experts each token is routed to.")
    linear_modules: list[str] = Field(
        max_length=64, description="Decoder-layer linear modules (LoRA target names)."
    )


class ParamCountsOut(Out):
    total: int = Field(ge=0, description="Parameters, counted from the architecture.")
    active: int = Field(ge=0, description="Parameters one token passes through (MoE: fewer).")
    embedding: int = Field(ge=0, description="Embedding parameters.")
    per_layer: int = Field(ge=0, description="Parameters of one decoder layer.")
    published: int = Field(ge=0, description="The total its publisher states.")
    published_source: str = Field(max_length=1024, description="Where the published total is.")


class ModelOut(Out):
    id: str = Field(max_length=256, description="Catalog id (a Hugging Face Hub id).")
    aliases: list[str] = Field(max_length=64, description="Other ids that resolve to it.")
    source: str = Field(max_length=1024, description="Where its config.json values come from.")
    architecture: ArchitectureOut = Field(description="The architecture.")
    params: ParamCountsOut = Field(description="Parameter counts.")

    @classmethod
    def from_core(cls, entry: CatalogEntry) -> ModelOut:
        arch = entry.arch
        return cls(
            id=entry.id,
            aliases=list(entry.aliases),
            source=entry.source,
            architecture=ArchitectureOut(
                model_type=arch.model_type,
                hidden_size=arch.hidden_size,
                num_hidden_layers=arch.num_hidden_layers,
                num_attention_heads=arch.num_attention_heads,
                num_key_value_heads=arch.num_key_value_heads,
                head_dim=arch.head_dim,
                intermediate_size=arch.intermediate_size,
                vocab_size=arch.vocab_size,
                max_position_embeddings=arch.max_position_embeddings,
                tie_word_embeddings=arch.tie_word_embeddings,
                num_experts=arch.num_experts,
                num_experts_per_tok=arch.num_experts_per_tok,
                linear_modules=[lin.name for lin in arch.linears],
            ),
            params=ParamCountsOut(
                total=arch.total_params,
                active=arch.active_params,
                embedding=arch.embedding_params,
                per_layer=arch.layer_params,
                published=entry.published_params,
                published_source=entry.published_params_source,
            ),
        )


class GpuCatalogEntryOut(Out):
    name: str = Field(max_length=128, description="Catalog name.")
    driver_name: str = Field(max_length=128, description="The name nvidia-smi prints.")
    memory_mib: int = Field(ge=0, description="Total memory as the driver reports it, MiB.")
    memory_bytes: Bytes = Field(description="The same total in bytes.")
    usable_bytes: Bytes = Field(description="What a process can fill: total minus the driver's.")
    bf16: bool = Field(description="Computes in bf16.")
    fp8: bool = Field(description="Computes in fp8.")
    compute_capability: str = Field(max_length=8, description="CUDA compute capability.")
    source: str = Field(max_length=1024, description="Where the memory total comes from.")


class GpuListOut(Out):
    gpus: list[GpuCatalogEntryOut] = Field(max_length=10_000, description="Catalog GPUs.")

    @classmethod
    def from_catalog(cls, catalog: GpuCatalog) -> GpuListOut:
        return cls(
            gpus=[
                GpuCatalogEntryOut(
                    name=gpu.name,
                    driver_name=gpu.driver_name,
                    memory_mib=gpu.memory_mib,
                    memory_bytes=gpu.memory_bytes,
                    usable_bytes=usable_bytes(gpu.memory_bytes),
                    bf16=gpu.bf16,
                    fp8=gpu.fp8,
                    compute_capability=gpu.compute_capability,
                    source=gpu.source,
                )
                for gpu in catalog.gpus()
            ]
        )


class HealthOut(Out):
    status: Literal["ok", "unavailable"] = Field(description="ok, or why not ready.")
    checks: dict[str, bool] = Field(max_length=16, description="Each readiness check's result.")


class ReadinessOut(HealthOut):
    reasons: dict[str, str] = Field(
        max_length=16, description="Why each failing check failed, in words (none when ready)."
    )
