"""The job spec: pydantic at the edge, mapped to the core's TrainingSpec explicitly.

Single-field bounds live here (a 422 names the field); combinations of fields are checked by
the core, whose errors `problems` locates in the request.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import (
    BeforeValidator,
    ConfigDict,
    Field,
    JsonValue,
    StringConstraints,
    model_validator,
)
from pydantic_core import PydanticCustomError

from service.api.schemas.base import Boolean, In, Number, integers
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
    ModuleList,
    OftIn,
    PrefixTuningIn,
    PromptTuningIn,
    VeraIn,
)
from service.api.schemas.quantization import QuantizationIn
from service.api.schemas.vision import VisionIn
from service.core.allocator import AllocatorConfig
from service.core.errors import InvalidSpecError
from service.core.limits import (
    MAX_ALLOC_SETTING_MB,
    MAX_BATCH_SIZE,
    MAX_BUCKET_CAP_MB,
    MAX_GPU_MEMORY_MIB,
    MAX_GPUS,
    MAX_GRAD_NORM,
    MAX_GRADIENT_ACCUMULATION,
    MAX_LORA_ALPHA,
    MAX_LORA_R,
    MAX_MODULES,
    MAX_NUM_LABELS,
    MAX_ROUNDUP_POWER2_DIVISIONS,
    MAX_SEQ_LEN,
    MAX_ZERO_ELEMENTS,
)
from service.core.parallel_config import parallel_from_deepspeed, parallel_from_fsdp
from service.core.spec import (
    ALL_LINEAR,
    DDP_BUCKET_CAP_MB,
    DEFAULT_GPUS_PER_NODE,
    ZERO3_MAX_LIVE_PARAMETERS,
    ZERO_ALLGATHER_BUCKET_SIZE,
    AttnImpl,
    DpoSpec,
    Framework,
    FsdpBackwardPrefetch,
    FsdpSharding,
    LoraSpec,
    LossImpl,
    Method,
    Objective,
    Offload,
    Optim,
    ParallelSpec,
    SdpaKernel,
    Strategy,
    TrainingSpec,
    objective_from,
)
from service.core.stack import PINNED_STACK, STACK_PRESETS, VERSION_PATTERN, Stack
from service.core.units import DType

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


class LoraIn(In):
    """PEFT LoraConfig; the defaults are PEFT's."""

    integer_fields = integers("r", "lora_alpha")

    r: int = Field(default=8, ge=1, le=MAX_LORA_R, description="LoRA rank.")
    lora_alpha: int = Field(
        default=8, ge=1, le=MAX_LORA_ALPHA, description="LoRA scaling numerator (no memory)."
    )
    lora_dropout: Number | None = Field(
        default=None,
        ge=0.0,
        lt=1.0,
        description="Dropout on the adapter input; null: the framework's (PEFT 0.0, LitGPT 0.05).",
    )
    target_modules: Literal["all-linear"] | ModuleList | None = Field(
        default=None,
        description="Adapted modules, or 'all-linear'; null: PEFT's default for the model.",
    )
    modules_to_save: list[Literal["embed_tokens", "lm_head"]] = Field(
        default_factory=list,
        max_length=MAX_MODULES,
        description="Modules trained in full beside the adapters: the embedding, the LM head.",
    )
    adapter_dtype: DType | None = Field(
        default=None,
        description="Adapter weights' dtype; null: the framework's (fp32 for HF + PEFT).",
    )
    use_dora: Boolean = Field(
        default=False,
        description="DoRA (PEFT use_dora): a magnitude vector per adapted linear, more saved "
        "for backward.",
    )
    use_rslora: Boolean = Field(
        default=False,
        description="rsLoRA (PEFT use_rslora): scaling lora_alpha/sqrt(r); no memory change.",
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
            use_dora=self.use_dora,
            use_rslora=self.use_rslora,
        )


class DpoIn(In):
    """TRL DPOConfig's settings that change memory (objective 'dpo' only)."""

    integer_fields = integers("max_completion_length")

    precompute_ref_log_probs: Boolean = Field(
        default=False,
        description="DPOConfig.precompute_ref_log_probs: the reference's log-probs computed "
        "before training, so no reference forward in the step and, for full fine-tuning, no "
        "reference copy of the model.",
    )
    max_completion_length: int | None = Field(
        default=None,
        ge=1,
        le=MAX_SEQ_LEN,
        description="Completion tokens of each sequence (older DPOConfig's name): only they go "
        "through TRL's fused LM head. null: the whole sequence is completion (the largest).",
    )

    def to_spec(self) -> DpoSpec:
        return DpoSpec(
            precompute_ref_log_probs=self.precompute_ref_log_probs,
            max_completion_length=self.max_completion_length,
        )


def _not_both(first: str, second: str) -> dict[str, JsonValue]:
    """JSON Schema for "not both of these objects" (either may be null or left out; the model
    validator enforces it)."""
    given: JsonValue = {"type": "object"}
    return {"not": {"required": [first, second], "properties": {first: given, second: given}}}


class ParallelIn(In):
    """How the job spans GPUs, with each strategy's settings by its library's names and
    defaults (torch DDP and FSDP, accelerate's FSDP plugin, DeepSpeed's zero_optimization)."""

    integer_fields = integers(
        "gpus",
        "gpus_per_node",
        "bucket_cap_mb",
        "reduce_bucket_size",
        "allgather_bucket_size",
        "stage3_prefetch_bucket_size",
        "stage3_max_live_parameters",
        "stage3_param_persistence_threshold",
    )

    gpus: int = Field(default=1, ge=1, le=MAX_GPUS, description="GPUs (ranks) the job spans.")
    strategy: Strategy = Field(
        default=Strategy.DDP,
        description="ddp, fsdp (FSDP1), fsdp2 (fully_shard), or DeepSpeed zero1/zero2/zero3.",
    )
    offload: Offload = Field(default=Offload.NONE, description="What is offloaded to the host.")
    gpus_per_node: int | None = Field(
        default=None,
        ge=1,
        le=MAX_GPUS,
        description=f"GPUs per node; null: min(gpus, {DEFAULT_GPUS_PER_NODE}).",
    )
    bucket_cap_mb: int = Field(
        default=DDP_BUCKET_CAP_MB, ge=1, le=MAX_BUCKET_CAP_MB, description="DDP's bucket cap (MB)."
    )
    gradient_as_bucket_view: Boolean = Field(
        default=False, description="DDP: gradients are views into the buckets."
    )
    sharding_strategy: FsdpSharding = Field(
        default=FsdpSharding.FULL_SHARD, description="FSDP1's sharding strategy."
    )
    use_orig_params: Boolean = Field(default=True, description="FSDP1's use_orig_params.")
    limit_all_gathers: Boolean = Field(default=True, description="FSDP1's limit_all_gathers.")
    forward_prefetch: Boolean = Field(default=False, description="FSDP1's forward_prefetch.")
    backward_prefetch: FsdpBackwardPrefetch = Field(
        default=FsdpBackwardPrefetch.BACKWARD_PRE, description="FSDP1's backward_prefetch."
    )
    reshard_after_forward: Boolean = Field(
        default=True, description="FSDP2's reshard_after_forward."
    )
    reduce_bucket_size: int | None = Field(
        default=None,
        ge=1,
        le=MAX_ZERO_ELEMENTS,
        description="ZeRO's reduce_bucket_size (elements); null: 'auto' (hidden_size²).",
    )
    allgather_bucket_size: int = Field(
        default=ZERO_ALLGATHER_BUCKET_SIZE,
        ge=1,
        le=MAX_ZERO_ELEMENTS,
        description="ZeRO-1/2's allgather_bucket_size (elements).",
    )
    stage3_prefetch_bucket_size: int | None = Field(
        default=None,
        ge=1,
        le=MAX_ZERO_ELEMENTS,
        description="ZeRO-3's prefetch bucket (elements); null: 'auto' (0.9 hidden_size²).",
    )
    stage3_max_live_parameters: int = Field(
        default=ZERO3_MAX_LIVE_PARAMETERS,
        ge=1,
        le=MAX_ZERO_ELEMENTS,
        description="ZeRO-3's stage3_max_live_parameters (elements).",
    )
    stage3_param_persistence_threshold: int | None = Field(
        default=None,
        ge=0,
        le=MAX_ZERO_ELEMENTS,
        description="ZeRO-3's persistence threshold (elements); null: 'auto' (10 hidden_size).",
    )
    contiguous_gradients: Boolean = Field(default=True, description="ZeRO's contiguous_gradients.")
    overlap_comm: Boolean | None = Field(
        default=None, description="ZeRO's overlap_comm; null: DeepSpeed's default for the stage."
    )

    deepspeed_config: ConfigJson | None = Field(
        default=None,
        description="A DeepSpeed config JSON as HF Trainer takes it (--deepspeed): its "
        "zero_optimization section sets strategy, offload and the ZeRO settings; fields given "
        "here beside it win.",
    )
    fsdp_config: ConfigJson | None = Field(
        default=None,
        description="An FSDP config: HF Trainer's fsdp_config, or accelerate's (fsdp_-prefixed "
        "keys): version, reshard_after_forward, cpu_offload, backward_prefetch, ...; its "
        "activation_checkpointing turns on gradient checkpointing. Fields given here beside "
        "it win.",
    )

    model_config = ConfigDict(json_schema_extra=_not_both("deepspeed_config", "fsdp_config"))

    @model_validator(mode="after")
    def _one_config(self) -> Self:
        if self.deepspeed_config is not None and self.fsdp_config is not None:
            raise ValueError("give deepspeed_config or fsdp_config, not both")
        return self

    def to_spec(self) -> ParallelSpec:
        if not self.model_fields_set:  # the default layout: one spec for every such job
            return _DEFAULT_PARALLEL
        fields = {
            name: getattr(self, name) for name in ParallelIn.model_fields if name not in _CONFIGS
        }
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


Version = Annotated[
    str,
    StringConstraints(min_length=1, max_length=64, pattern=VERSION_PATTERN.pattern),
    Field(description="A release version, e.g. '4.48.0'."),
]
StackPreset = Literal["hf-5.24", "hf-4.48", "hf-4.16"]


class StackIn(In):
    """The library versions the job runs on; absent ones: the traced stack's."""

    transformers: Version = Field(default=PINNED_STACK.transformers)
    peft: Version = Field(default=PINNED_STACK.peft)
    bitsandbytes: Version = Field(default=PINNED_STACK.bitsandbytes)
    torch: Version = Field(default=PINNED_STACK.torch)

    def to_spec(self) -> Stack:
        return Stack(
            transformers=self.transformers,
            peft=self.peft,
            bitsandbytes=self.bitsandbytes,
            torch=self.torch,
        )


class AllocatorIn(In):
    """PyTorch's CUDA caching allocator settings (PYTORCH_CUDA_ALLOC_CONF); PyTorch's defaults
    when left out."""

    integer_fields = integers(
        "max_split_size_mb", "max_non_split_rounding_mb", "roundup_power2_divisions"
    )

    max_split_size_mb: int | None = Field(
        default=None,
        ge=20,
        le=MAX_ALLOC_SETTING_MB,
        description="Blocks this large are never split.",
    )
    max_non_split_rounding_mb: int | None = Field(
        default=None,
        ge=20,
        le=MAX_ALLOC_SETTING_MB,
        description="How much larger an unsplit block may be than a large request.",
    )
    roundup_power2_divisions: int = Field(
        default=0,
        ge=0,
        le=MAX_ROUNDUP_POWER2_DIVISIONS,
        description="Round sizes to power-of-two divisions.",
    )
    garbage_collection_threshold: Number = Field(
        default=0.0,
        ge=0.0,
        lt=1.0,
        description="Free cached blocks past this share of the allowed memory (needs a fraction).",
    )
    expandable_segments: Boolean = Field(
        default=False, description="Grow segments page by page instead of new ones."
    )
    per_process_memory_fraction: Number | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="torch.cuda.set_per_process_memory_fraction, if the job sets one.",
    )

    def to_spec(self) -> AllocatorConfig:
        if not self.model_fields_set:  # PyTorch's defaults: one config for every such job
            return _DEFAULT_ALLOCATOR
        return AllocatorConfig(**self.model_dump())


_CONFIGS = ("deepspeed_config", "fsdp_config")


def _deepspeed_fields(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    return parallel_from_deepspeed(config), {}


# The specs of the defaults, built once from the models' own defaults (frozen, so shared).
_DEFAULT_PARALLEL = ParallelSpec(
    **{
        name: getattr(ParallelIn(), name)
        for name in ParallelIn.model_fields
        if name not in _CONFIGS
    }
)
_DEFAULT_ALLOCATOR = AllocatorConfig(**AllocatorIn().model_dump())


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


class JobSpec(In):
    """A fine-tuning job; everything but model, batch_size and seq_len defaults to what
    HF Trainer + PEFT do."""

    integer_fields = integers(
        "batch_size", "seq_len", "gradient_accumulation_steps", "num_labels", "target_length"
    )

    model: ModelField = Field(
        description="A catalog id (string), or {'hf_config': config.json}.",
    )
    method: Method = Field(
        default=Method.LORA,
        description=(
            "full, lora, qlora, lora-fa (LoRA with A frozen, PEFT's LoRA-FA optimizer), PEFT's "
            "ia3, ln-tuning, prompt-tuning, prefix-tuning, vera, loha, lokr, adalora, oft or "
            "boft, or LitGPT's "
            "llama-adapter or llama-adapter-v2 (framework 'litgpt' only)."
        ),
    )
    objective: str = Field(
        default=Objective.SFT.value,
        max_length=MAX_OBJECTIVE_CHARS,
        description=(
            "The training objective, as TRL names its trainers: sft (the causal-LM loss, "
            "SFTTrainer's and HF Trainer's) or dpo (DPOTrainer: batch_size pairs run as "
            "2 x batch_size sequences of seq_len tokens, a reference model's forward) or "
            "reward (RewardTrainer: a one-label sequence classifier, batch_size pairs run as "
            "2 x batch_size sequences in one forward, no LM head) or kto (KTOTrainer: "
            "batch_size unpaired examples, a KL batch and a reference model's forwards), orpo "
            "(ORPOTrainer: batch_size pairs run as 2 x batch_size sequences with the whole "
            "logits kept, no reference model) or grpo (GRPOTrainer: model.generate's "
            "completions, batch_size of them, then the policy's loss on them). Other trainers "
            "(rloo, cpo, ...) are a 422: not modelled."
        ),
    )
    dpo: DpoIn | None = Field(
        default=None, description="DPO settings (objective 'dpo' only); null: DPOConfig's."
    )
    kto: KtoIn | None = Field(
        default=None, description="KTO settings (objective 'kto' only); null: KTOConfig's."
    )
    grpo: GrpoIn | None = Field(
        default=None, description="GRPO settings (objective 'grpo' only); null: GRPOConfig's."
    )
    orpo: OrpoIn | None = Field(
        default=None, description="ORPO settings (objective 'orpo' only); null: ORPOConfig's."
    )
    lora: LoraIn | None = Field(
        default=None,
        description="LoRA options (lora, qlora, lora-fa); null: PEFT's defaults.",
    )
    quantization: QuantizationIn | None = Field(
        default=None,
        description=(
            "Quantization (qlora, or a 4-bit base under LitGPT's adapters); null: NF4 with "
            "kbit preparation for qlora, an unquantized base for the adapters."
        ),
    )
    ia3: IA3In | None = Field(
        default=None, description="(IA)^3 options (ia3 only); null: PEFT's defaults."
    )
    ln_tuning: LnTuningIn | None = Field(
        default=None, description="LN tuning options (ln-tuning only); null: PEFT's defaults."
    )
    prompt_tuning: PromptTuningIn | None = Field(
        default=None, description="Prompt tuning options (prompt-tuning only, required there)."
    )
    prefix_tuning: PrefixTuningIn | None = Field(
        default=None, description="Prefix tuning options (prefix-tuning only, required there)."
    )
    vera: VeraIn | None = Field(
        default=None, description="VeRA options (vera only); null: PEFT's defaults."
    )
    loha: LohaIn | None = Field(
        default=None, description="LoHa options (loha only); null: PEFT's defaults."
    )
    lokr: LokrIn | None = Field(
        default=None, description="LoKr options (lokr only); null: PEFT's defaults."
    )
    adalora: AdaLoraIn | None = Field(
        default=None, description="AdaLoRA options (adalora only); null: PEFT's defaults."
    )
    oft: OftIn | None = Field(
        default=None, description="OFT options (oft only); null: PEFT's defaults."
    )
    boft: BoftIn | None = Field(
        default=None, description="BOFT options (boft only); null: PEFT's defaults."
    )
    dtype: DType = Field(default=DType.BF16, description="torch_dtype the base is loaded in.")
    autocast: Boolean = Field(default=False, description="TrainingArguments bf16/fp16 autocast.")
    optim: Optim = Field(default=Optim.ADAMW_TORCH_FUSED, description="TrainingArguments.optim.")
    batch_size: int = Field(ge=1, le=MAX_BATCH_SIZE, description="Micro-batch per GPU.")
    seq_len: int = Field(ge=1, le=MAX_SEQ_LEN, description="Tokens per sequence.")
    gradient_accumulation_steps: int = Field(
        default=1, ge=1, le=MAX_GRADIENT_ACCUMULATION, description="Micro-batches per step."
    )
    max_grad_norm: Number = Field(
        default=1.0,
        ge=0,
        le=MAX_GRAD_NORM,
        allow_inf_nan=False,
        description="TrainingArguments.max_grad_norm: gradient clipping, 0 for none.",
    )
    gradient_checkpointing: Boolean = Field(
        default=False, description="TrainingArguments.gradient_checkpointing."
    )
    optimizer_in_backward: Boolean = Field(
        default=False,
        description="torchtune's optimizer_in_bwd (framework 'torchtune', full fine-tuning, "
        "one GPU, no accumulation or clipping): each parameter stepped as its gradient lands.",
    )
    activation_offloading: Boolean = Field(
        default=False,
        description="torchtune's enable_activation_offloading (framework 'torchtune', with "
        "gradient_checkpointing): saved activations kept in pinned host memory.",
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
    liger_kernel: Boolean = Field(
        default=False,
        description="TrainingArguments.use_liger_kernel: liger-kernel 0.8.2's RoPE, RMSNorm, "
        "SwiGLU/GEGLU, fused linear cross-entropy (loss 'fused'): llama, mistral, qwen2, gemma2.",
    )
    torch_compile: Boolean = Field(
        default=False,
        description="TrainingArguments.torch_compile. Not traced: the eager step is "
        "estimated, and the answer says so (inductor usually keeps no more).",
    )
    packing: Boolean = Field(
        default=False,
        description="TRL's padding-free packing (SFTConfig padding_free=True, or packing=True "
        "with its default 'bfd' strategy): the micro-batch's batch_size sequences of up to "
        "seq_len tokens run as one row of batch_size x seq_len tokens, position_ids restarting "
        "at each. Under SDPA the row gets a block-diagonal mask; flash_attention_2 runs it "
        "varlen. Objective 'sft', framework 'hf', decoder-only models.",
    )
    parallel: ParallelIn = Field(
        default_factory=ParallelIn, description="Multi-GPU layout; default one GPU."
    )
    allocator: AllocatorIn = Field(
        default_factory=AllocatorIn,
        description="PYTORCH_CUDA_ALLOC_CONF settings; default: PyTorch's.",
    )
    num_labels: int | None = Field(
        default=None,
        ge=1,
        le=MAX_NUM_LABELS,
        description="Classes of an encoder's sequence-classification head (BERT); null: the "
        "model's, 2 by default. Encoder models only.",
    )
    target_length: int | None = Field(
        default=None,
        ge=1,
        le=MAX_SEQ_LEN,
        description="An encoder-decoder's (T5) target length: the decoder's tokens (the "
        "labels); seq_len is then the encoder's (the source's). null: as long as seq_len. "
        "Encoder-decoder models only.",
    )
    vision: VisionIn | None = Field(
        default=None,
        description="A vision-language model's image inputs (Qwen2-VL, Qwen2.5-VL: images per "
        "sample and their size or tokens, which seq_len counts; Llama-3.2-Vision: images per "
        "sample and their size, tiled, seq_len counting text only). Required for such a model; "
        "null otherwise.",
    )
    gpu: GpuField | None = Field(
        default=None,
        description="The GPU it runs on (optional): adds a fit summary, scopes calibration.",
    )
    stack: StackField = Field(
        default_factory=StackIn,
        description=(
            "The library versions it runs on: a preset ('hf-5.24', the traced stack, 'hf-4.48' "
            "or 'hf-4.16') or {transformers, peft, bitsandbytes, torch}. The answer names the "
            "stack it modelled; a job whose memory differs there in a way not modelled is a 422."
        ),
    )

    def _gradient_checkpointing(self) -> bool:
        """As given, else as an FSDP config's activation checkpointing sets it."""
        if "gradient_checkpointing" in self.model_fields_set or self.parallel.fsdp_config is None:
            return self.gradient_checkpointing
        return bool(self.parallel.config_fields()[1].get("gradient_checkpointing", False))

    def to_spec(self) -> TrainingSpec:
        """The core spec; raises InvalidSpecError for invalid combinations."""
        # The objective's name is checked before any combination, as the core codec checks it
        # with the fields' values (service/core/codec.py `_objective`).
        objective = objective_from(self.objective)
        return TrainingSpec(
            method=self.method,
            batch_size=self.batch_size,
            seq_len=self.seq_len,
            lora=None if self.lora is None else self.lora.to_spec(),
            quantization=None if self.quantization is None else self.quantization.to_spec(),
            ia3=None if self.ia3 is None else self.ia3.to_spec(),
            ln_tuning=None if self.ln_tuning is None else self.ln_tuning.to_spec(),
            prompt_tuning=None if self.prompt_tuning is None else self.prompt_tuning.to_spec(),
            prefix_tuning=None if self.prefix_tuning is None else self.prefix_tuning.to_spec(),
            vera=None if self.vera is None else self.vera.to_spec(),
            loha=None if self.loha is None else self.loha.to_spec(),
            lokr=None if self.lokr is None else self.lokr.to_spec(),
            adalora=None if self.adalora is None else self.adalora.to_spec(),
            oft=None if self.oft is None else self.oft.to_spec(),
            boft=None if self.boft is None else self.boft.to_spec(),
            dtype=self.dtype,
            autocast=self.autocast,
            optim=self.optim,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            max_grad_norm=self.max_grad_norm,
            gradient_checkpointing=self._gradient_checkpointing(),
            optimizer_in_backward=self.optimizer_in_backward,
            activation_offloading=self.activation_offloading,
            attn_implementation=self.attn_implementation,
            sdpa_kernel=self.sdpa_kernel,
            loss=self.loss,
            framework=self.framework,
            packing=self.packing,
            torch_compile=self.torch_compile,
            liger_kernel=self.liger_kernel,
            parallel=self.parallel.to_spec(),
            allocator=self.allocator.to_spec(),
            num_labels=self.num_labels,
            target_length=self.target_length,
            stack=self.stack.to_spec(),
            objective=objective,
            dpo=None if self.dpo is None else self.dpo.to_spec(),
            kto=None if self.kto is None else self.kto.to_spec(),
            grpo=None if self.grpo is None else self.grpo.to_spec(),
            orpo=None if self.orpo is None else self.orpo.to_spec(),
            vision=None if self.vision is None else self.vision.to_spec(),
        )
