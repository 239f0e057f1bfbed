"""Request and response bodies: pydantic at the edge, mapped to and from the core explicitly.

Single-field bounds live here (a 422 names the field); combinations of fields are checked by
the core, whose errors `problems` locates in the request.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import fields, is_dataclass
from enum import Enum
from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    JsonValue,
    PlainValidator,
    StringConstraints,
    ValidationError,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import core_schema

from service.api.calibration import AppliedCalibration, CalibratedPeaks, LevelFactor
from service.api.problems import FieldError, Problem, field_error
from service.calibration_service import FactorState
from service.catalog.gpus import GpuCatalog
from service.catalog.models import CatalogEntry, ModelCatalog
from service.core.allocator import AllocatorConfig
from service.core.calibration import Level
from service.core.fit import CHANGE_WORDS, Change, GpuFit, Suggestion, usable_bytes
from service.core.limits import (
    MAX_BATCH_SIZE,
    MAX_GPUS,
    MAX_GRAD_NORM,
    MAX_GRADIENT_ACCUMULATION,
    MAX_LORA_ALPHA,
    MAX_LORA_R,
    MAX_MODULES,
    MAX_SEQ_LEN,
)
from service.core.result import PHASE_WORDS, Component, Estimate, Overhead, Phase
from service.core.spec import (
    ALL_LINEAR,
    AttnImpl,
    Framework,
    LoraSpec,
    LossImpl,
    Method,
    Offload,
    Optim,
    ParallelSpec,
    QuantSpec,
    QuantType,
    SdpaKernel,
    Strategy,
    TrainingSpec,
)
from service.core.units import DType

MAX_BATCH_JOBS = 1000
MAX_FIT_GPUS = 64
# Reported totals: from 1 GiB (nothing smaller trains a model) to 4 TiB.
MIN_MEMORY_MIB = 1024
MAX_MEMORY_MIB = 4 * 1024 * 1024
MAX_PRICE_PER_HOUR = 1_000_000.0
MAX_CONFIG_KEYS = 1024

ModuleName = Annotated[
    str,
    StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.]+$"),
    Field(description="A module name as transformers names it, e.g. 'q_proj'."),
]
ModelId = Annotated[
    str,
    StringConstraints(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$"),
    Field(description="A catalog model id, e.g. 'Qwen/Qwen2.5-7B-Instruct' (see /v1/models)."),
]
GpuName = Annotated[
    str,
    StringConstraints(min_length=1, max_length=128),
    Field(description="A catalog GPU name ('A100-80GB') or the name nvidia-smi prints."),
]
Bytes = Annotated[int, Field(ge=0, description="Bytes.")]
ModuleList = Annotated[list[ModuleName], Field(min_length=1, max_length=MAX_MODULES)]
ConfigKey = Annotated[str, StringConstraints(max_length=256)]
ConfigJson = Annotated[dict[ConfigKey, JsonValue], Field(max_length=MAX_CONFIG_KEYS)]
MemoryMib = Annotated[int, Field(ge=MIN_MEMORY_MIB, le=MAX_MEMORY_MIB)]


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Out(BaseModel):
    """A response body."""

    model_config = ConfigDict(extra="forbid", frozen=True)


# ---------------------------------------------------------------------------------------------
# The job spec


class LoraIn(_In):
    """PEFT LoraConfig; the defaults are PEFT's."""

    r: int = Field(default=8, ge=1, le=MAX_LORA_R, description="LoRA rank.")
    lora_alpha: int = Field(
        default=8, ge=1, le=MAX_LORA_ALPHA, description="LoRA scaling numerator (no memory)."
    )
    lora_dropout: float | None = Field(
        default=None,
        ge=0.0,
        lt=1.0,
        description="Dropout on the adapter input; null: the framework's (PEFT 0.0, LitGPT 0.05).",
    )
    target_modules: Literal["all-linear"] | ModuleList | None = Field(
        default=None,
        description="Adapted modules, or 'all-linear'; null: PEFT's default for the model.",
    )
    modules_to_save: list[ModuleName] = Field(
        default_factory=list,
        max_length=MAX_MODULES,
        description="Modules trained in full beside the adapters, e.g. 'embed_tokens'.",
    )
    adapter_dtype: DType | None = Field(
        default=None,
        description="Adapter weights' dtype; null: the framework's (fp32 for HF + PEFT).",
    )

    def to_spec(self) -> LoraSpec:
        targets: tuple[str, ...] | str | None
        if self.target_modules is None or self.target_modules == ALL_LINEAR:
            targets = self.target_modules
        else:
            targets = tuple(self.target_modules)
        return LoraSpec(
            r=self.r,
            lora_alpha=self.lora_alpha,
            lora_dropout=self.lora_dropout,
            target_modules=targets,
            modules_to_save=tuple(self.modules_to_save),
            adapter_dtype=self.adapter_dtype,
        )


class QuantizationIn(_In):
    """bitsandbytes quantization of the frozen base (BitsAndBytesConfig); QLoRA only."""

    type: QuantType = Field(default=QuantType.NF4, description="Quantized weight format.")
    double_quant: bool = Field(
        default=False, description="bnb_4bit_use_double_quant (quantized absmax)."
    )
    compute_dtype: DType | None = Field(
        default=None, description="bnb_4bit_compute_dtype; null: the model's dtype."
    )
    prepare_kbit: bool = Field(
        default=True, description="peft.prepare_model_for_kbit_training is applied."
    )

    def to_spec(self) -> QuantSpec:
        return QuantSpec(
            type=self.type,
            double_quant=self.double_quant,
            compute_dtype=self.compute_dtype,
            prepare_kbit=self.prepare_kbit,
        )


class ParallelIn(_In):
    """How the job spans GPUs."""

    gpus: int = Field(default=1, ge=1, le=MAX_GPUS, description="GPUs (ranks) the job spans.")
    strategy: Strategy = Field(default=Strategy.DDP, description="Data-parallel strategy.")
    offload: Offload = Field(default=Offload.NONE, description="What is offloaded to the host.")

    def to_spec(self) -> ParallelSpec:
        return ParallelSpec(gpus=self.gpus, strategy=self.strategy, offload=self.offload)


class AllocatorIn(_In):
    """PyTorch's CUDA caching allocator settings (PYTORCH_CUDA_ALLOC_CONF); PyTorch's defaults
    when left out."""

    max_split_size_mb: int | None = Field(
        default=None, ge=20, le=1 << 20, description="Blocks this large are never split."
    )
    max_non_split_rounding_mb: int | None = Field(
        default=None,
        ge=20,
        le=1 << 20,
        description="How much larger an unsplit block may be than a large request.",
    )
    roundup_power2_divisions: int = Field(
        default=0, ge=0, le=1 << 10, description="Round sizes to power-of-two divisions."
    )
    garbage_collection_threshold: float = Field(
        default=0.0,
        ge=0.0,
        lt=1.0,
        description="Free cached blocks past this share of the allowed memory (needs a fraction).",
    )
    expandable_segments: bool = Field(
        default=False, description="Grow segments page by page instead of new ones."
    )
    per_process_memory_fraction: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="torch.cuda.set_per_process_memory_fraction, if the job sets one.",
    )

    def to_spec(self) -> AllocatorConfig:
        return AllocatorConfig(**self.model_dump())


def _model_shorthand(value: Any) -> Any:
    return {"id": value} if isinstance(value, str) else value


def _exactly_one(*names: str) -> dict[str, JsonValue]:
    """JSON Schema for "exactly one of these fields" (the model validator enforces it)."""
    return {"oneOf": [{"required": [name]} for name in names]}


def _absent_not_null(schema: dict[str, JsonValue]) -> None:
    """A field that is left out rather than sent as null: no null branch, no null default."""
    schema.pop("default", None)
    branches = schema.pop("anyOf", None)
    if isinstance(branches, list):
        kept = [b for b in branches if isinstance(b, dict) and b.get("type") != "null"]
        if len(kept) == 1 and isinstance(kept[0], dict):
            schema.update(kept[0])


class _OneOf(_In):
    """Exactly one of `_choices` is given; none of them may be null."""

    _choices: ClassVar[tuple[str, str]]

    @model_validator(mode="before")
    @classmethod
    def _no_nulls(cls, data: Any) -> Any:
        if isinstance(data, dict):
            nulls = [name for name in cls._choices if name in data and data[name] is None]
            if nulls:
                raise ValueError(f"{nulls[0]} must not be null; leave it out instead")
        return data

    @model_validator(mode="after")
    def _one_of(self) -> Self:
        first, second = self._choices
        if (getattr(self, first) is None) == (getattr(self, second) is None):
            raise ValueError(f"give either {first} or {second}")
        return self


class ModelRef(_OneOf):
    """The model: a catalog id, or a config.json as published on the Hugging Face Hub."""

    model_config = ConfigDict(json_schema_extra=_exactly_one("id", "hf_config"))
    _choices = ("id", "hf_config")

    id: ModelId | None = Field(
        default=None, description="A catalog model id.", json_schema_extra=_absent_not_null
    )
    hf_config: ConfigJson | None = Field(
        default=None,
        description="A model's config.json, as published (model_type, hidden_size, ...).",
        json_schema_extra=_absent_not_null,
    )


def _gpu_shorthand(value: Any) -> Any:
    return {"name": value} if isinstance(value, str) else value


class GpuRef(_OneOf):
    """A GPU: by name (catalog or nvidia-smi's), or by the total memory the node reports."""

    model_config = ConfigDict(json_schema_extra=_exactly_one("name", "memory_mib"))
    _choices = ("name", "memory_mib")

    name: GpuName | None = Field(
        default=None, description="Catalog or nvidia-smi name.", json_schema_extra=_absent_not_null
    )
    memory_mib: MemoryMib | None = Field(
        default=None,
        description="Total memory as the driver reports it, MiB (nvidia.com/gpu.memory).",
        json_schema_extra=_absent_not_null,
    )


class GpuOfferIn(GpuRef):
    """A GPU type to check, with how many the job spans and what one costs."""

    count: int | None = Field(
        default=None, ge=1, le=MAX_GPUS, description="GPUs the job spans; null: parallel.gpus."
    )
    price_per_hour: float | None = Field(
        default=None,
        ge=0.0,
        le=MAX_PRICE_PER_HOUR,
        allow_inf_nan=False,
        description="Price of one GPU per hour, any currency; enables the cheapest answer.",
    )


ModelField = Annotated[
    ModelRef, BeforeValidator(_model_shorthand, json_schema_input_type=ModelId | ModelRef)
]
GpuField = Annotated[
    GpuRef, BeforeValidator(_gpu_shorthand, json_schema_input_type=GpuName | GpuRef)
]
GpuOfferField = Annotated[
    GpuOfferIn, BeforeValidator(_gpu_shorthand, json_schema_input_type=GpuName | GpuOfferIn)
]


class JobSpec(_In):
    """A fine-tuning job; everything but model, batch_size and seq_len defaults to what
    HF Trainer + PEFT do."""

    model: ModelField = Field(
        description="A catalog id (string), or {'hf_config': config.json}.",
    )
    method: Method = Field(default=Method.LORA, description="full, lora or qlora.")
    lora: LoraIn | None = Field(
        default=None, description="LoRA options (lora and qlora); null: PEFT's defaults."
    )
    quantization: QuantizationIn | None = Field(
        default=None, description="Quantization (qlora only); null: NF4 with kbit preparation."
    )
    dtype: DType = Field(default=DType.BF16, description="torch_dtype the base is loaded in.")
    autocast: bool = Field(default=False, description="TrainingArguments bf16/fp16 autocast.")
    optim: Optim = Field(default=Optim.ADAMW_TORCH_FUSED, description="TrainingArguments.optim.")
    batch_size: int = Field(ge=1, le=MAX_BATCH_SIZE, description="Micro-batch per GPU.")
    seq_len: int = Field(ge=1, le=MAX_SEQ_LEN, description="Tokens per sequence.")
    gradient_accumulation_steps: int = Field(
        default=1, ge=1, le=MAX_GRADIENT_ACCUMULATION, description="Micro-batches per step."
    )
    max_grad_norm: float = Field(
        default=1.0,
        ge=0,
        le=MAX_GRAD_NORM,
        allow_inf_nan=False,
        description="TrainingArguments.max_grad_norm: gradient clipping, 0 for none.",
    )
    gradient_checkpointing: bool = Field(
        default=False, description="TrainingArguments.gradient_checkpointing."
    )
    attn_implementation: AttnImpl = Field(
        default=AttnImpl.SDPA, description="transformers attn_implementation."
    )
    sdpa_kernel: SdpaKernel = Field(
        default=SdpaKernel.AUTO, description="Which SDPA backend runs; auto: PyTorch's pick."
    )
    loss: LossImpl | None = Field(
        default=None, description="Causal-LM loss implementation; null: the framework's."
    )
    framework: Framework = Field(default=Framework.HF, description="Training framework preset.")
    parallel: ParallelIn = Field(
        default_factory=ParallelIn, description="Multi-GPU layout; default one GPU."
    )
    allocator: AllocatorIn = Field(
        default_factory=AllocatorIn,
        description="PYTORCH_CUDA_ALLOC_CONF settings; default: PyTorch's.",
    )
    gpu: GpuField | None = Field(
        default=None,
        description="The GPU it runs on (optional): adds a fit summary, scopes calibration.",
    )

    def to_spec(self) -> TrainingSpec:
        """The core spec; raises InvalidSpecError for invalid combinations."""
        return TrainingSpec(
            method=self.method,
            batch_size=self.batch_size,
            seq_len=self.seq_len,
            lora=None if self.lora is None else self.lora.to_spec(),
            quantization=None if self.quantization is None else self.quantization.to_spec(),
            dtype=self.dtype,
            autocast=self.autocast,
            optim=self.optim,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            max_grad_norm=self.max_grad_norm,
            gradient_checkpointing=self.gradient_checkpointing,
            attn_implementation=self.attn_implementation,
            sdpa_kernel=self.sdpa_kernel,
            loss=self.loss,
            framework=self.framework,
            parallel=self.parallel.to_spec(),
            allocator=self.allocator.to_spec(),
        )


# ---------------------------------------------------------------------------------------------
# Estimates


class PeakOut(_Out):
    """The peak of one GPU of the job at the three levels, and the safe bound."""

    allocated_bytes: Bytes = Field(description="torch.cuda.max_memory_allocated() at the peak.")
    reserved_bytes: Bytes = Field(description="torch.cuda.max_memory_reserved() at the peak.")
    device_bytes: Bytes = Field(description="What nvidia-smi shows for the process (median).")
    device_bytes_upper: Bytes = Field(
        description="The safe bound to compare with a GPU: calibrated spread, or the prior margin."
    )
    step: int = Field(ge=1, le=2, description="1: no optimizer state yet; 2: the steady state.")
    phase: Phase = Field(description="Where in the step the peak happens.")
    phase_words: str = Field(max_length=256, description="The phase, in words.")


class LevelsOut(_Out):
    """The estimator's own peaks, before calibration."""

    allocated_bytes: Bytes = Field(description="Allocated level.")
    reserved_bytes: Bytes = Field(description="Reserved level.")
    device_bytes: Bytes = Field(description="Device level.")
    device_bytes_upper: Bytes = Field(description="Device level with the prior margin.")


class PhaseOut(_Out):
    """The allocated bytes at one phase of the step."""

    step: int = Field(ge=1, le=2, description="1: no optimizer state yet; 2: the steady state.")
    phase: Phase = Field(description="The phase.")
    allocated_bytes: Bytes = Field(description="Live bytes at this phase.")


class ParamsOut(_Out):
    total: int = Field(ge=0, description="Parameters of the model.")
    trainable: int = Field(ge=0, description="Parameters that take a gradient.")


class LevelCalibrationOut(_Out):
    """The factor that corrected one peak level."""

    level: Level = Field(description="allocated, reserved or device.")
    scope: str = Field(max_length=64, description="Where it came from (model_gpu, model, ...).")
    factor: float = Field(ge=0.0, description="measured / estimated, multiplied into the level.")
    nodes: int = Field(ge=0, description="Training nodes whose measurements voted.")
    samples: int = Field(ge=0, description="Measured runs behind the factor.")
    models: int = Field(
        ge=1, description="Models whose measurements voted: 1 unless the scope is global."
    )

    @classmethod
    def from_core(cls, level: LevelFactor) -> LevelCalibrationOut:
        return cls(
            level=level.level,
            scope=level.scope,
            factor=level.factor,
            nodes=level.nodes,
            samples=level.samples,
            models=level.models,
        )


class CalibrationOut(_Out):
    """The calibration applied: the device level's factor (the safe bound's), every level's
    factors, and whether the factors are fresh, stale (the store is down) or missing."""

    applied: bool = Field(description="Whether measured peaks corrected this estimate.")
    scope: str = Field(
        max_length=64,
        description="'none', or where the device level's factor came from (model, global, ...).",
    )
    factor: float | None = Field(
        default=None, ge=0.0, description="measured / estimated, multiplied into the estimate."
    )
    upper_multiplier: float | None = Field(
        default=None,
        ge=1.0,
        description="The safe bound over the calibrated device level: the measured spread, "
        "widened for few nodes.",
    )
    nodes: int = Field(ge=0, description="Training nodes whose measurements voted.")
    samples: int = Field(ge=0, description="Measured runs behind the factor.")
    levels: list[LevelCalibrationOut] = Field(
        max_length=3, description="Every level a factor corrected (allocated, reserved, device)."
    )
    state: FactorState = Field(
        description="The factors used: fresh (loaded from the store within seconds), stale (the "
        "store is unreachable: the last ones loaded) or none (none could be loaded)."
    )

    @classmethod
    def from_core(cls, applied: AppliedCalibration) -> CalibrationOut:
        return cls(
            applied=applied.applied,
            scope=applied.scope,
            factor=applied.factor,
            upper_multiplier=applied.upper_multiplier,
            nodes=applied.nodes,
            samples=applied.samples,
            levels=[LevelCalibrationOut.from_core(level) for level in applied.levels],
            state=applied.state,
        )


class GpuFitSummary(_Out):
    """Whether the job fits the GPU named in the spec."""

    name: str | None = Field(max_length=128, description="Catalog name; null: by memory only.")
    memory_bytes: Bytes = Field(description="Total memory as the driver reports it.")
    usable_bytes: Bytes = Field(description="Memory a process can fill (total - driver's share).")
    fits: bool = Field(description="device_bytes_upper <= usable_bytes.")
    headroom_bytes: int = Field(description="usable - device_bytes_upper; negative: no fit.")


ComponentBytes = dict[Component, Bytes]
# Iterating an enum runs Python code per member: the members, once.
_COMPONENTS = tuple(Component)
_OVERHEADS = tuple(Overhead)


class EstimateOut(_Out):
    """The peak memory of one GPU of the job, where it goes and when it happens."""

    model: str = Field(max_length=256, description="The catalog id, or 'hf_config'.")
    peak: PeakOut = Field(description="The peak, calibrated when calibration applies.")
    estimated: LevelsOut = Field(description="The estimator's peaks before calibration.")
    components: ComponentBytes = Field(
        description="Allocated bytes at the peak by role; they sum to estimated.allocated_bytes."
    )
    overheads: dict[Overhead, Bytes] = Field(
        description="Bytes above allocated: reserved and device levels add these."
    )
    phases: list[PhaseOut] = Field(max_length=16, description="Allocated bytes per phase.")
    params: ParamsOut = Field(description="Parameter counts.")
    upper_margin: float = Field(
        ge=0.0,
        description="The safe bound's margin over peak.device_bytes: the device factor's when "
        "calibration applied one, else the estimator's own.",
    )
    calibration: CalibrationOut = Field(description="The calibration applied.")
    gpu: GpuFitSummary | None = Field(default=None, description="Fit on the spec's GPU, if any.")
    assumptions: list[str] = Field(
        max_length=64,
        description="Defaults the estimate assumed; the last says what calibration applied: per "
        "level the factor, its scope, runs and nodes, and the safe bound's margin, or that none "
        "applied.",
    )
    warnings: list[str] = Field(max_length=64, description="What may make it wrong.")
    estimator_version: str = Field(max_length=32, description="Version of the estimator.")

    @classmethod
    def from_core(
        cls,
        model: str,
        est: Estimate,
        peaks: CalibratedPeaks,
        gpu: GpuFitSummary | None = None,
        warnings: tuple[str, ...] = (),
    ) -> EstimateOut:
        calibration = peaks.calibration
        upper_margin = calibration.upper_margin(est.upper_margin)
        # One validation of plain values (pydantic-core) is cheaper than building each
        # nested model in Python.
        return cls.model_validate(
            {
                "model": model,
                "peak": {
                    "allocated_bytes": peaks.allocated_bytes,
                    "reserved_bytes": peaks.reserved_bytes,
                    "device_bytes": peaks.device_bytes,
                    "device_bytes_upper": peaks.device_bytes_upper,
                    "step": est.peak_step,
                    "phase": est.peak_phase,
                    "phase_words": PHASE_WORDS[est.peak_phase],
                },
                "estimated": {
                    "allocated_bytes": est.allocated_bytes,
                    "reserved_bytes": est.reserved_bytes,
                    "device_bytes": est.device_bytes,
                    "device_bytes_upper": est.device_bytes_upper,
                },
                "components": {c: est.components.get(c, 0) for c in _COMPONENTS},
                "overheads": {o: est.overheads.get(o, 0) for o in _OVERHEADS},
                "phases": [
                    {"step": ph.step, "phase": ph.phase, "allocated_bytes": ph.allocated_bytes}
                    for ph in est.phases
                ],
                "params": {"total": est.params.total, "trainable": est.params.trainable},
                "upper_margin": upper_margin,
                "calibration": CalibrationOut.from_core(calibration),
                "gpu": gpu,
                # The API alone says what calibration applied: the core knows no factors.
                "assumptions": [*_core_notes(est.assumptions), calibration.note(upper_margin)],
                "warnings": [*est.warnings, *warnings],
                "estimator_version": est.estimator_version,
            }
        )


# A parenthesis of a core note that speaks of calibration is left out: the calibration note,
# which the API adds, says what applied.
_CORE_CALIBRATION_WORDS = re.compile(r"\s*\([^()]*calibrat[^()]*\)", re.IGNORECASE)


def _core_notes(notes: tuple[str, ...]) -> list[str]:
    return [_CORE_CALIBRATION_WORDS.sub("", n) if "calibrat" in n.lower() else n for n in notes]


# ---------------------------------------------------------------------------------------------
# Batches


class RejectedJob:
    """A batch entry that failed the schema; its errors are relative to the job."""

    __slots__ = ("errors",)

    def __init__(self, errors: tuple[FieldError, ...]) -> None:
        self.errors = errors

    @classmethod
    def __get_pydantic_core_schema__(
        cls, _source: type[Any], _handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        # Never validated from input (the batch's validator builds it), never in the schema.
        return core_schema.is_instance_schema(cls)


def _job_or_rejection(value: Any) -> JobSpec | RejectedJob:
    try:
        return JobSpec.model_validate(value)
    except ValidationError as exc:
        return RejectedJob(
            tuple(
                field_error(
                    tuple(p for p in err["loc"] if isinstance(p, str | int)),
                    err["msg"],
                    err["type"],
                )
                for err in exc.errors()
            )
        )


BatchJob = Annotated[
    JobSpec | SkipJsonSchema[RejectedJob],
    PlainValidator(_job_or_rejection, json_schema_input_type=JobSpec),
]


class BatchIn(_In):
    """Up to 1000 jobs estimated in one call; each job fails on its own."""

    jobs: list[BatchJob] = Field(
        min_length=1, max_length=MAX_BATCH_JOBS, description="The jobs, answered in this order."
    )


class BatchResultOut(_Out):
    """One job's answer: its estimate, or the problem that stopped it."""

    index: int = Field(ge=0, lt=MAX_BATCH_JOBS, description="Position of the job in `jobs`.")
    status: int = Field(ge=200, le=599, description="200, or the problem's status.")
    estimate: EstimateOut | None = Field(default=None, description="The estimate, on success.")
    problem: Problem | None = Field(default=None, description="The problem, on failure.")


class BatchOut(_Out):
    results: list[BatchResultOut] = Field(
        max_length=MAX_BATCH_JOBS, description="One result per job, in order."
    )
    succeeded: int = Field(ge=0, le=MAX_BATCH_JOBS, description="Jobs estimated.")
    failed: int = Field(ge=0, le=MAX_BATCH_JOBS, description="Jobs answered with a problem.")


# ---------------------------------------------------------------------------------------------
# Fit checks


class FitCheckIn(_In):
    """A job and the GPU types it might run on."""

    job: JobSpec = Field(description="The job (its `gpu` field is not used here).")
    gpus: list[GpuOfferField] = Field(
        min_length=1,
        max_length=MAX_FIT_GPUS,
        description="GPU types: a name (string), or {name | memory_mib, count, price_per_hour}.",
    )


class GpuOut(_Out):
    """A GPU as asked for, and as the catalog knows it."""

    requested: str = Field(max_length=128, description="The name or memory, as given.")
    name: str | None = Field(max_length=128, description="Catalog name; null: not in it.")
    driver_name: str | None = Field(max_length=128, description="The name nvidia-smi prints.")
    memory_mib: int = Field(ge=0, description="Total memory as the driver reports it, MiB.")
    memory_bytes: Bytes = Field(description="The same total in bytes.")
    matched_by: Literal["name", "memory_mib"] = Field(description="How it was matched.")
    bf16: bool | None = Field(description="Computes in bf16; null: unknown.")
    fp8: bool | None = Field(description="Computes in fp8; null: unknown.")
    compute_capability: str | None = Field(
        default=None,
        max_length=8,
        description="CUDA compute capability ('9.0'); picks the device level's row.",
    )


class SuggestionOut(_Out):
    """A change to the job and the requirement it leads to."""

    changes: list[Change] = Field(max_length=16, description="What to change, in rank order.")
    description: str = Field(max_length=1024, description="The changes, in words.")
    set: dict[str, JsonValue] = Field(
        max_length=32, description="The job fields to set (as in the request), new values."
    )
    required_bytes: Bytes = Field(description="The safe bound after the change.")
    fits: bool = Field(description="Whether the changed job fits this GPU.")

    @classmethod
    def from_core(cls, job: TrainingSpec, suggestion: Suggestion) -> SuggestionOut:
        return cls(
            changes=list(suggestion.changes),
            description="; ".join(CHANGE_WORDS[c] for c in suggestion.changes),
            set=spec_changes(job, suggestion.spec),
            required_bytes=suggestion.requirement.device_bytes_upper,
            fits=suggestion.fits,
        )


class GpuFitOut(_Out):
    """The job on one GPU type."""

    gpu: GpuOut = Field(description="The GPU.")
    count: int = Field(ge=1, le=MAX_GPUS, description="GPUs the job spans on this type.")
    fits: bool = Field(description="required_bytes <= usable_bytes.")
    usable_bytes: Bytes = Field(description="Driver-reported total minus what CUDA cannot use.")
    required_bytes: Bytes = Field(description="The job's safe bound (device_bytes_upper).")
    required_bytes_median: Bytes = Field(description="The job's median device-level peak.")
    headroom_bytes: int = Field(description="usable - required; negative when it does not fit.")
    utilisation: float = Field(ge=0.0, description="required / usable.")
    max_batch_size: int = Field(
        ge=0, le=MAX_BATCH_SIZE, description="Largest micro-batch that fits at this seq_len."
    )
    max_seq_len: int = Field(
        ge=0,
        le=MAX_SEQ_LEN,
        description="Longest sequence that fits at this batch, up to the model's context.",
    )
    suggestions: list[SuggestionOut] = Field(
        max_length=16, description="Changes that lower the requirement, those that fit first."
    )
    cost_per_hour: float | None = Field(
        default=None, ge=0.0, description="price_per_hour * count, when a price was given."
    )

    @classmethod
    def from_core(
        cls, gpu: GpuOut, fit: GpuFit, describe: Callable[[Suggestion], SuggestionOut]
    ) -> GpuFitOut:
        """`describe` turns a suggestion into its answer (GPUs of one check share most)."""
        return cls(
            gpu=gpu,
            count=fit.count,
            fits=fit.fits,
            usable_bytes=fit.usable_bytes,
            required_bytes=fit.requirement.device_bytes_upper,
            required_bytes_median=fit.requirement.device_bytes,
            headroom_bytes=fit.headroom_bytes,
            utilisation=fit.utilisation,
            max_batch_size=fit.max_batch_size,
            max_seq_len=fit.max_seq_len,
            suggestions=[describe(s) for s in fit.suggestions],
            cost_per_hour=fit.cost_per_hour,
        )


class CheapestOut(_Out):
    index: int = Field(ge=0, lt=MAX_FIT_GPUS, description="Position in `gpus`.")
    name: str = Field(max_length=128, description="The GPU, as requested.")
    cost_per_hour: float = Field(ge=0.0, description="price_per_hour * count.")


class FitCheckOut(_Out):
    """Per GPU type: does the job fit, how far it can grow, and what makes it fit."""

    job: EstimateOut = Field(description="The job's estimate as specified.")
    results: list[GpuFitOut] = Field(
        max_length=MAX_FIT_GPUS, description="One per requested GPU, in order."
    )
    cheapest: CheapestOut | None = Field(
        default=None, description="The cheapest priced GPU that fits; null: none."
    )


def spec_changes(old: TrainingSpec, new: TrainingSpec) -> dict[str, JsonValue]:
    """The job fields that differ, named and valued as in the request body."""
    changed: dict[str, JsonValue] = {}
    for f in fields(old):
        before, after = getattr(old, f.name), getattr(new, f.name)
        if before == after:
            continue
        if is_dataclass(before) and is_dataclass(after):
            changed[f.name] = {
                g.name: _json(getattr(after, g.name))
                for g in fields(after)
                if getattr(before, g.name) != getattr(after, g.name)
            }
        else:
            changed[f.name] = _json(after)
    return changed


def _json(value: object) -> JsonValue:
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, tuple):
        return [_json(v) for v in value]
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _json(getattr(value, f.name)) for f in fields(value)}
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


# ---------------------------------------------------------------------------------------------
# Catalogs


class ModelSummaryOut(_Out):
    id: str = Field(max_length=256, description="Catalog id (a Hugging Face Hub id).")
    aliases: list[str] = Field(max_length=64, description="Other ids that resolve to it.")
    model_type: str = Field(max_length=64, description="config.json model_type.")
    total_params: int = Field(ge=0, description="Parameters, counted from the architecture.")


class ModelListOut(_Out):
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


class ArchitectureOut(_Out):
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


class ParamCountsOut(_Out):
    total: int = Field(ge=0, description="Parameters, counted from the architecture.")
    active: int = Field(ge=0, description="Parameters one token passes through (MoE: fewer).")
    embedding: int = Field(ge=0, description="Embedding parameters.")
    per_layer: int = Field(ge=0, description="Parameters of one decoder layer.")
    published: int = Field(ge=0, description="The total its publisher states.")
    published_source: str = Field(max_length=1024, description="Where the published total is.")


class ModelOut(_Out):
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


class GpuCatalogEntryOut(_Out):
    name: str = Field(max_length=128, description="Catalog name.")
    driver_name: str = Field(max_length=128, description="The name nvidia-smi prints.")
    memory_mib: int = Field(ge=0, description="Total memory as the driver reports it, MiB.")
    memory_bytes: Bytes = Field(description="The same total in bytes.")
    usable_bytes: Bytes = Field(description="What a process can fill: total minus the driver's.")
    bf16: bool = Field(description="Computes in bf16.")
    fp8: bool = Field(description="Computes in fp8.")
    compute_capability: str = Field(max_length=8, description="CUDA compute capability.")
    source: str = Field(max_length=1024, description="Where the memory total comes from.")


class GpuListOut(_Out):
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


class HealthOut(_Out):
    status: Literal["ok", "unavailable"] = Field(description="ok, or why not ready.")
    checks: dict[str, bool] = Field(max_length=16, description="Each readiness check's result.")
