"""The client's own request and result types, mirroring openapi/openapi.json.

Requests are checked before they leave (`extra="forbid"`, the API's enums), so a typo fails
here rather than as a 422. Results ignore members they do not know, so a newer service that
adds a field does not break an older client; enum-valued results stay plain strings for the
same reason. Optional request fields default to None and are left out of the body, so the
service applies its own defaults. The request models (`Job` and its sections, the enums' names,
`GpuOffer`, `PlacementRequest`, `CalibrationUpload` and its parts) are generated from
openapi/openapi.json into `vramcast_client._generated` and re-exported here.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

# The request models, generated from the OpenAPI document (python -m service.openapi --client).
from vramcast_client._generated import (
    IA3,
    AdaLora,
    Allocator,
    AttnImplName,
    Boft,
    CalibrationUpload,
    Dpo,
    DTypeName,
    Environment,
    FrameworkName,
    FsdpBackwardPrefetchName,
    FsdpShardingName,
    GpuOffer,
    GpuRef,
    Grpo,
    Job,
    Kto,
    LnTuning,
    Loha,
    Lokr,
    Lora,
    LossName,
    MeasuredPeaks,
    MethodName,
    ModelRef,
    OffloadName,
    Oft,
    OptimName,
    Orpo,
    OutcomeName,
    Parallel,
    PlacementRequest,
    PrefixTuning,
    PromptTuning,
    Quantization,
    QuantTypeName,
    SdpaKernelName,
    Stack,
    StrategyName,
    UploadGpu,
    Vera,
    Vision,
)
from vramcast_client.errors import Problem

# The training objectives the service models, by TRL's trainer names.
ObjectiveName = Literal["sft", "dpo", "reward", "kto", "orpo", "grpo"]

# Every public name: the generated request models re-exported, and this module's own.
__all__ = [
    "IA3",
    "AdaLora",
    "Allocator",
    "AppliedCalibration",
    "AppliedFactor",
    "Architecture",
    "AttnImplName",
    "BatchEstimates",
    "BatchResult",
    "Boft",
    "CalibrationReceipt",
    "CalibrationUpload",
    "Cheapest",
    "DTypeName",
    "Dpo",
    "Environment",
    "Estimate",
    "FitCheck",
    "FrameworkName",
    "FsdpBackwardPrefetchName",
    "FsdpShardingName",
    "Generation",
    "GpuCatalogEntry",
    "GpuFit",
    "GpuFitSummary",
    "GpuList",
    "GpuMatch",
    "GpuOffer",
    "GpuRef",
    "Grpo",
    "Job",
    "Kto",
    "LevelCalibration",
    "Levels",
    "LnTuning",
    "Loha",
    "Lokr",
    "Lora",
    "LossName",
    "MeasuredPeaks",
    "MethodName",
    "Model",
    "ModelList",
    "ModelRef",
    "ModelSummary",
    "ObjectiveName",
    "OffloadName",
    "Oft",
    "OptimName",
    "Orpo",
    "OutcomeName",
    "Parallel",
    "ParamCounts",
    "Params",
    "Peak",
    "PhaseBytes",
    "Placement",
    "PlacementPick",
    "PlacementRequest",
    "Placements",
    "PrefixTuning",
    "PromptTuning",
    "QuantTypeName",
    "Quantization",
    "SdpaKernelName",
    "Stack",
    "StrategyName",
    "Suggestion",
    "UploadGpu",
    "UploadRatio",
    "Vera",
    "Vision",
]


class _Result(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


# Results ----------------------------------------------------------------------------------


class Levels(_Result):
    allocated_bytes: int
    reserved_bytes: int
    device_bytes: int
    device_bytes_upper: int


class Peak(Levels):
    """The peak at the three levels and the safe bound (`device_bytes_upper`)."""

    step: int
    phase: str
    phase_words: str


class LevelCalibration(_Result):
    """The factor that corrected one peak level."""

    level: str
    scope: str
    factor: float
    nodes: int
    samples: int


class AppliedCalibration(_Result):
    """Whether measured peaks corrected the estimate; `state`: the factors were fresh,
    stale (the service's store is down) or none; `table_id`: which factor table the replica
    applied (replicas that loaded the same table name it alike)."""

    applied: bool
    scope: str
    factor: float | None = None
    upper_multiplier: float | None = None
    nodes: int
    samples: int
    levels: list[LevelCalibration] = []
    state: str = "none"
    table_id: str | None = None


class GpuFitSummary(_Result):
    name: str | None
    memory_bytes: int
    usable_bytes: int
    fits: bool
    headroom_bytes: int


class PhaseBytes(_Result):
    step: int
    phase: str
    allocated_bytes: int


class Params(_Result):
    total: int
    trainable: int


class Generation(_Result):
    """GRPO's generation phase at its peak (step 2), its KV cache apart."""

    allocated_bytes: int
    kv_cache_bytes: int


class Estimate(_Result):
    """A job's peak on one GPU, where it goes and when it happens."""

    model: str
    peak: Peak
    estimated: Levels
    components: dict[str, int]
    overheads: dict[str, int]
    phases: list[PhaseBytes]
    generation: Generation | None = None  # GRPO's generation phase; None for other objectives
    params: Params
    host_bytes: int = 0
    host_pinned_bytes: int = 0  # pinned host memory of offloaded activations
    upper_margin: float
    calibration: AppliedCalibration
    gpu: GpuFitSummary | None = None
    assumptions: list[str]
    warnings: list[str]
    estimator_version: str


class BatchResult(_Result):
    """One job of a batch: its estimate, or the problem that stopped it."""

    index: int
    status: int
    estimate: Estimate | None = None
    problem: Problem | None = None

    @property
    def ok(self) -> bool:
        return self.estimate is not None


class BatchEstimates(_Result):
    results: list[BatchResult]
    succeeded: int
    failed: int


class GpuMatch(_Result):
    """A GPU as asked for, and as the catalog knows it."""

    requested: str
    name: str | None
    driver_name: str | None
    memory_mib: int
    memory_bytes: int
    matched_by: str
    bf16: bool | None = None
    fp8: bool | None = None
    compute_capability: str | None = None


class Suggestion(_Result):
    changes: list[str]
    description: str
    set: dict[str, Any]
    required_bytes: int
    fits: bool


class GpuFit(_Result):
    """The job on one GPU type."""

    gpu: GpuMatch
    count: int
    fits: bool
    usable_bytes: int
    required_bytes: int
    required_bytes_median: int
    headroom_bytes: int
    utilisation: float
    max_batch_size: int
    max_seq_len: int
    suggestions: list[Suggestion]
    cost_per_hour: float | None = None


class Cheapest(_Result):
    index: int
    name: str
    cost_per_hour: float


class Placement(_Result):
    """One GPU type under one strategy: the fewest GPUs that hold the job, or why none."""

    gpu_index: int
    gpu: str
    strategy: str
    outcome: str  # fits, does_not_fit, not_possible
    count: int | None = None
    nodes: int | None = None
    cost_per_hour: float | None = None
    usable_bytes: int
    required_bytes: int | None = None
    headroom_bytes: int | None = None
    previous_count: int | None = None
    previous_required_bytes: int | None = None
    reason: str | None = None
    per_gpu: Estimate | None = None


class PlacementPick(_Result):
    index: int
    gpu: str
    strategy: str
    count: int
    cost_per_hour: float | None = None


class Placements(_Result):
    strategies: list[str]
    max_gpus: int
    gpus_per_node: int
    counts: list[int]
    placements: list[Placement]
    cheapest: PlacementPick | None = None
    fewest: PlacementPick | None = None


class FitCheck(_Result):
    job: Estimate
    results: list[GpuFit]
    cheapest: Cheapest | None = None
    placement: Placements | None = None

    @property
    def fits_all(self) -> bool:
        return all(result.fits for result in self.results)

    @property
    def fits_any(self) -> bool:
        return any(result.fits for result in self.results)


class ModelSummary(_Result):
    id: str
    aliases: list[str]
    model_type: str
    total_params: int


class ModelList(_Result):
    models: list[ModelSummary]


class Architecture(_Result):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    num_experts: int
    num_experts_per_tok: int
    linear_modules: list[str]


class ParamCounts(_Result):
    total: int
    active: int
    embedding: int
    per_layer: int
    published: int
    published_source: str


class Model(_Result):
    id: str
    aliases: list[str]
    source: str
    architecture: Architecture
    params: ParamCounts


class GpuCatalogEntry(_Result):
    name: str
    driver_name: str
    memory_mib: int
    memory_bytes: int
    usable_bytes: int
    bf16: bool
    fp8: bool
    compute_capability: str
    source: str


class GpuList(_Result):
    gpus: list[GpuCatalogEntry]


class AppliedFactor(_Result):
    scope: str
    ratio: float
    nodes: int


class UploadRatio(_Result):
    """measured / estimated at one level of an upload."""

    level: str
    measured_bytes: int
    estimated_bytes: int
    ratio: float
    outlier: bool
    outlier_reason: str | None = None
    factor: AppliedFactor | None = None


class CalibrationReceipt(_Result):
    """What an upload stored; `replayed`: the service had stored it before (same key)."""

    id: int
    received_at: datetime
    model: str
    estimator_version: str | None = None
    estimate_error: str | None = None
    ratios: list[UploadRatio] = []
    replayed: bool = False  # from the answer: 200 with Idempotent-Replayed, not 201
