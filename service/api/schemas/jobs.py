"""The job spec: pydantic at the edge, its models made from the core's field declarations
(service/core/fields.py) and mapped to the core's TrainingSpec by them.

Single-field bounds live in the declarations (a 422 names the field); combinations of fields
are checked by the core, whose errors `problems` locates in the request.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Self

from pydantic import (
    BeforeValidator,
    ConfigDict,
    Field,
    JsonValue,
    StringConstraints,
    model_validator,
)
from pydantic_core import PydanticCustomError

from service.api.schemas.base import In, Number, integers
from service.api.schemas.declared import DeclaredIn, declared_model
from service.api.schemas.grpo import GrpoIn
from service.api.schemas.kto import KtoIn
from service.api.schemas.orpo import OrpoIn
from service.api.schemas.peft_methods import (
    AdaLoraIn,
    BoftIn,
    IA3In,
    LnTuningIn,
    LohaIn,
    LokrIn,
    OftIn,
    PrefixTuningIn,
    PromptTuningIn,
    VeraIn,
)
from service.api.schemas.quantization import QuantizationIn
from service.api.schemas.vision import VisionIn
from service.core.allocator import AllocatorConfig
from service.core.errors import InvalidSpecError
from service.core.fields import declared_fields
from service.core.limits import MAX_GPU_MEMORY_MIB, MAX_GPUS
from service.core.parallel_config import parallel_from_deepspeed, parallel_from_fsdp
from service.core.spec import (
    DpoSpec,
    LoraSpec,
    Method,
    Objective,
    ParallelSpec,
    TrainingSpec,
    objective_from,
)
from service.core.stack import STACK_PRESETS, Stack

MAX_BATCH_JOBS = 1000
MAX_OBJECTIVE_CHARS = 32  # longer than any trainer name TRL has
MAX_FIT_GPUS = 64
# Reported totals: from 1 GiB (nothing smaller trains a model) to the core's bound (4 TiB).
MIN_MEMORY_MIB = 1024
MAX_MEMORY_MIB = MAX_GPU_MEMORY_MIB
MAX_PRICE_PER_HOUR = 1_000_000.0
MAX_CONFIG_KEYS = 1024
# A model id: what the calibration store keeps of one (its model column), far longer than any
# id on the Hugging Face Hub.
MAX_MODEL_ID_CHARS = 200

ModelId = Annotated[
    str,
    StringConstraints(
        min_length=1, max_length=MAX_MODEL_ID_CHARS, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$"
    ),
    Field(description="A catalog model id, e.g. 'Qwen/Qwen2.5-7B-Instruct' (see /v1/models)."),
]
GpuName = Annotated[
    str,
    StringConstraints(min_length=1, max_length=128),
    Field(description="A catalog GPU name ('A100-80GB') or the name nvidia-smi prints."),
]
ConfigKey = Annotated[str, StringConstraints(max_length=256)]
ConfigJson = Annotated[dict[ConfigKey, JsonValue], Field(max_length=MAX_CONFIG_KEYS)]
MemoryMib = Annotated[int, Field(ge=MIN_MEMORY_MIB, le=MAX_MEMORY_MIB)]

# ---------------------------------------------------------------------------------------------
# The job spec

LoraIn = declared_model(
    "LoraIn", LoraSpec, doc="PEFT LoraConfig; the defaults are PEFT's.", base=DeclaredIn
)
DpoIn = declared_model(
    "DpoIn",
    DpoSpec,
    doc="TRL DPOConfig's settings that change memory (objective 'dpo' only).",
    base=DeclaredIn,
)


def _not_both(first: str, second: str) -> dict[str, JsonValue]:
    """JSON Schema for "not both of these objects" (either may be null or left out; the model
    validator enforces it)."""
    given: JsonValue = {"type": "object"}
    return {"not": {"required": [first, second], "properties": {first: given, second: given}}}


class _Parallel(DeclaredIn):
    """ParallelIn's checks and its spec: the declared fields, or what a DeepSpeed or FSDP
    config sets of them where they are not given."""

    model_config = ConfigDict(json_schema_extra=_not_both("deepspeed_config", "fsdp_config"))

    if TYPE_CHECKING:
        deepspeed_config: dict[str, JsonValue] | None
        fsdp_config: dict[str, JsonValue] | None

    @model_validator(mode="after")
    def _one_config(self) -> Self:
        if self.deepspeed_config is not None and self.fsdp_config is not None:
            raise ValueError("give deepspeed_config or fsdp_config, not both")
        return self

    def to_spec(self) -> ParallelSpec:
        if not self.model_fields_set:  # the default layout: one spec for every such job
            return super().to_spec()  # type: ignore[no-any-return]
        fields = self.spec_values()
        from_config = self.config_fields()[0]
        for name, value in from_config.items():
            if name not in self.model_fields_set:
                fields[name] = value
        return ParallelSpec(**fields)

    def config_fields(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The parallel fields and the job fields the given config sets; InvalidSpecError names
        the config's key under `parallel.<config>.`."""
        for name, read in (
            ("deepspeed_config", _deepspeed_fields),
            ("fsdp_config", parallel_from_fsdp),
        ):
            config = getattr(self, name)
            if config is None:
                continue
            try:
                return read(config)
            except InvalidSpecError as exc:
                raise InvalidSpecError(f"parallel.{name}.{exc.field}", exc.reason) from None
        return {}, {}


ParallelIn = declared_model(
    "ParallelIn",
    ParallelSpec,
    doc="""How the job spans GPUs, with each strategy's settings by its library's names and
    defaults (torch DDP and FSDP, accelerate's FSDP plugin, DeepSpeed's zero_optimization).""",
    base=_Parallel,
    extra={
        "deepspeed_config": (
            ConfigJson | None,
            Field(
                default=None,
                description="A DeepSpeed config JSON as HF Trainer takes it (--deepspeed): its "
                "zero_optimization section sets strategy, offload and the ZeRO settings; fields "
                "given here beside it win.",
            ),
        ),
        "fsdp_config": (
            ConfigJson | None,
            Field(
                default=None,
                description="An FSDP config: HF Trainer's fsdp_config, or accelerate's "
                "(fsdp_-prefixed keys): version, reshard_after_forward, cpu_offload, "
                "backward_prefetch, ...; its activation_checkpointing turns on gradient "
                "checkpointing. Fields given here beside it win.",
            ),
        ),
    },
)
StackPreset = Literal["hf-5.24", "hf-4.48", "hf-4.16"]
StackIn = declared_model(
    "StackIn",
    Stack,
    doc="The library versions the job runs on; absent ones: the traced stack's.",
    base=DeclaredIn,
)
AllocatorIn = declared_model(
    "AllocatorIn",
    AllocatorConfig,
    doc="""PyTorch's CUDA caching allocator settings (PYTORCH_CUDA_ALLOC_CONF); PyTorch's defaults
    when left out.""",
    base=DeclaredIn,
)


def _deepspeed_fields(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    return parallel_from_deepspeed(config), {}


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


class _OneOf(In):
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

    integer_fields = integers("memory_mib")

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

    offer_integer_fields = integers("count")

    count: int | None = Field(
        default=None, ge=1, le=MAX_GPUS, description="GPUs the job spans; null: parallel.gpus."
    )
    price_per_hour: Number | None = Field(
        default=None,
        ge=0.0,
        le=MAX_PRICE_PER_HOUR,
        allow_inf_nan=False,
        description="Price of one GPU per hour, any currency; enables the cheapest answer.",
    )


def _stack_preset(value: Any) -> Any:
    """A preset's name stands for its versions."""
    if not isinstance(value, str):
        return value
    if value not in STACK_PRESETS:
        known = ", ".join(STACK_PRESETS)
        raise PydanticCustomError(
            "stack_preset",
            "'{name}' is not a stack preset (known: {known})",
            {"name": value, "known": known},
        )
    stack = STACK_PRESETS[value]
    return {name: getattr(stack, name) for name in StackIn.model_fields}


if TYPE_CHECKING:
    StackField = DeclaredIn
else:
    StackField = Annotated[
        StackIn, BeforeValidator(_stack_preset, json_schema_input_type=StackPreset | StackIn)
    ]
ModelField = Annotated[
    ModelRef, BeforeValidator(_model_shorthand, json_schema_input_type=ModelId | ModelRef)
]
GpuField = Annotated[
    GpuRef, BeforeValidator(_gpu_shorthand, json_schema_input_type=GpuName | GpuRef)
]
GpuOfferField = Annotated[
    GpuOfferIn, BeforeValidator(_gpu_shorthand, json_schema_input_type=GpuName | GpuOfferIn)
]


# The models of the job's nested specs, made before JobSpec, whose fields take them.
NESTED_MODELS = (
    LoraIn,
    QuantizationIn,
    IA3In,
    LnTuningIn,
    PromptTuningIn,
    PrefixTuningIn,
    VeraIn,
    LohaIn,
    LokrIn,
    AdaLoraIn,
    OftIn,
    BoftIn,
    DpoIn,
    KtoIn,
    GrpoIn,
    OrpoIn,
    VisionIn,
    ParallelIn,
    AllocatorIn,
    StackIn,
)


class _Job(DeclaredIn):
    """JobSpec's spec: the declared fields, the objective read first (as the core codec reads
    it with the fields' values, service/core/codec.py) and gradient checkpointing as an FSDP
    config's activation checkpointing sets it where it is not given."""

    if TYPE_CHECKING:
        model: ModelRef
        gpu: GpuRef | None
        method: Method
        objective: str
        batch_size: int
        seq_len: int
        gradient_checkpointing: bool
        parallel: _Parallel

    def _gradient_checkpointing(self) -> bool:
        """As given, else as an FSDP config's activation checkpointing sets it."""
        if "gradient_checkpointing" in self.model_fields_set or self.parallel.fsdp_config is None:
            return self.gradient_checkpointing
        return bool(self.parallel.config_fields()[1].get("gradient_checkpointing", False))

    def to_spec(self) -> TrainingSpec:
        """The core spec; raises InvalidSpecError for invalid combinations."""
        objective = objective_from(self.objective)
        read: dict[str, Callable[[], Any]] = {
            "objective": lambda: objective,
            "gradient_checkpointing": self._gradient_checkpointing,
        }
        return TrainingSpec(**self.spec_values(read))


def _doc(name: str) -> str | None:
    """The declared doc of one of the job's fields."""
    return next(d.rules.doc for d in declared_fields(TrainingSpec) if d.name == name)


# The request's field order: what a request names first (the model, the method and objective
# and their options) before the shape and the switches; fields not named here follow.
_JOB_ORDER = (
    "model",
    "method",
    "objective",
    "dpo",
    "kto",
    "grpo",
    "orpo",
    "lora",
    "quantization",
    "ia3",
    "ln_tuning",
    "prompt_tuning",
    "prefix_tuning",
    "vera",
    "loha",
    "lokr",
    "adalora",
    "oft",
    "boft",
    "dtype",
    "autocast",
    "optim",
    "batch_size",
    "seq_len",
    "gradient_accumulation_steps",
    "max_grad_norm",
    "gradient_checkpointing",
    "optimizer_in_backward",
    "activation_offloading",
    "attn_implementation",
    "sdpa_kernel",
    "loss",
    "framework",
    "liger_kernel",
    "torch_compile",
    "packing",
    "parallel",
    "allocator",
    "num_labels",
    "target_length",
    "vision",
    "gpu",
    "stack",
)

if TYPE_CHECKING:
    JobSpec = _Job
else:
    JobSpec = declared_model(
        "JobSpec",
        TrainingSpec,
        doc="""A fine-tuning job; everything but model, batch_size and seq_len defaults to what
    HF Trainer + PEFT do.""",
        base=_Job,
        order=_JOB_ORDER,
        extra={
            "model": (
                ModelField,
                Field(description="A catalog id (string), or {'hf_config': config.json}."),
            ),
            "objective": (
                str,
                Field(
                    default=Objective.SFT.value,
                    max_length=MAX_OBJECTIVE_CHARS,
                    description=_doc("objective"),
                ),
            ),
            "gpu": (
                GpuField | None,
                Field(
                    default=None,
                    description="The GPU it runs on (optional): adds a fit summary, scopes "
                    "calibration.",
                ),
            ),
            "stack": (StackField, Field(default_factory=StackIn, description=_doc("stack"))),
        },
    )
