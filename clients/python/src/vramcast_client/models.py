"""The client's own request and result types, mirroring openapi/openapi.json.

Requests are checked before they leave (`extra="forbid"`, the API's enums), so a typo fails
here rather than as a 422. Results ignore members they do not know, so a newer service that
adds a field does not break an older client; enum-valued results stay plain strings for the
same reason. Optional request fields default to None and are left out of the body, so the
service applies its own defaults.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from vramcast_client.errors import Problem

MethodName = Literal[
    "full",
    "lora",
    "qlora",
    "lora-fa",
    "vera",
    "loha",
    "lokr",
    "adalora",
    "oft",
    "boft",
    "prefix-tuning",
]
DTypeName = Literal["fp32", "bf16", "fp16"]
OptimName = Literal[
    "adamw_torch",
    "adamw_torch_fused",
    "adamw_bnb_8bit",
    "paged_adamw_8bit",
    "paged_adamw_32bit",
    "adafactor",
    "sgd",
]
AttnImplName = Literal["eager", "sdpa", "flash_attention_2"]
SdpaKernelName = Literal["auto", "flash", "efficient", "math"]
LossName = Literal["hf", "plain", "chunked", "fused"]
FrameworkName = Literal["hf", "litgpt", "torchtune"]
StrategyName = Literal["ddp", "fsdp", "fsdp2", "zero1", "zero2", "zero3"]
FsdpShardingName = Literal["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"]
FsdpBackwardPrefetchName = Literal["BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"]
OffloadName = Literal["none", "optimizer", "optimizer_and_params"]
QuantTypeName = Literal[
    "nf4", "fp4", "int8", "gptq", "awq", "hqq", "torchao-int4", "torchao-float8"
]
OutcomeName = Literal["completed", "oom"]
# The training objectives the service models, by TRL's trainer names.
ObjectiveName = Literal["sft", "dpo", "reward", "kto", "orpo", "grpo"]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def to_json(self) -> dict[str, Any]:
        """The request body: unset options left out (the service fills its defaults)."""
        return self.model_dump(mode="json", exclude_none=True)


class _Result(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


# Requests ---------------------------------------------------------------------------------


class ModelRef(_Request):
    """A catalog id, or a config.json as published on the Hugging Face Hub: give one."""

    id: str | None = None
    hf_config: dict[str, Any] | None = None


class GpuRef(_Request):
    """A GPU by name (catalog or nvidia-smi's), or by the total memory the node reports."""

    name: str | None = None
    memory_mib: int | None = Field(default=None, ge=1)


class Lora(_Request):
    """PEFT LoraConfig; None: PEFT's default."""

    r: int | None = Field(default=None, ge=1)
    lora_alpha: int | None = Field(default=None, ge=1)
    lora_dropout: float | None = Field(default=None, ge=0.0, lt=1.0)
    target_modules: Literal["all-linear"] | list[str] | None = None
    modules_to_save: list[str] | None = None
    adapter_dtype: DTypeName | None = None
    use_dora: bool | None = None  # DoRA: a magnitude vector per adapted linear
    use_rslora: bool | None = None  # rsLoRA scaling; no memory change


class Vera(_Request):
    """PEFT VeraConfig (method vera); None: PEFT's default."""

    r: int | None = Field(default=None, ge=1)
    target_modules: Literal["all-linear"] | list[str] | None = None
    vera_dropout: float | None = Field(default=None, ge=0.0, lt=1.0)
    d_initial: float | None = None
    projection_prng_key: int | None = Field(default=None, ge=0)
    save_projection: bool | None = None


class Loha(_Request):
    """PEFT LoHaConfig (method loha); None: PEFT's default."""

    r: int | None = Field(default=None, ge=1)
    alpha: int | None = Field(default=None, ge=1)
    rank_dropout: float | None = Field(default=None, ge=0.0, lt=1.0)
    module_dropout: float | None = Field(default=None, ge=0.0, lt=1.0)
    target_modules: Literal["all-linear"] | list[str] | None = None


class Lokr(_Request):
    """PEFT LoKrConfig (method lokr); None: PEFT's default."""

    r: int | None = Field(default=None, ge=1)
    alpha: int | None = Field(default=None, ge=1)
    rank_dropout: float | None = Field(default=None, ge=0.0, lt=1.0)
    module_dropout: float | None = Field(default=None, ge=0.0, lt=1.0)
    decompose_both: bool | None = None
    decompose_factor: int | None = Field(default=None, ge=-1)
    rank_dropout_scale: bool | None = None
    target_modules: Literal["all-linear"] | list[str] | None = None


class AdaLora(_Request):
    """PEFT AdaLoraConfig (method adalora); None: PEFT's default."""

    init_r: int | None = Field(default=None, ge=1)
    target_r: int | None = Field(default=None, ge=1)
    lora_alpha: int | None = Field(default=None, ge=1)
    lora_dropout: float | None = Field(default=None, ge=0.0, lt=1.0)
    target_modules: Literal["all-linear"] | list[str] | None = None
    orth_reg_weight: float | None = Field(default=None, ge=0.0)
    tinit: int | None = Field(default=None, ge=0)
    tfinal: int | None = Field(default=None, ge=0)
    deltaT: int | None = Field(default=None, ge=1)
    beta1: float | None = Field(default=None, gt=0.0, lt=1.0)
    beta2: float | None = Field(default=None, gt=0.0, lt=1.0)
    total_step: int | None = Field(default=None, ge=1)


class Boft(_Request):
    """PEFT BOFTConfig (method boft); None: PEFT's default."""

    boft_block_size: int | None = Field(default=None, ge=0)
    boft_block_num: int | None = Field(default=None, ge=0)
    boft_n_butterfly_factor: int | None = Field(default=None, ge=1)
    boft_dropout: float | None = Field(default=None, ge=0.0, lt=1.0)
    bias: Literal["none", "all", "boft_only"] | None = None
    target_modules: Literal["all-linear"] | list[str] | None = None


class PrefixTuning(_Request):
    """PEFT PrefixTuningConfig (method prefix-tuning); num_virtual_tokens is required, as PEFT
    has no default."""

    num_virtual_tokens: int = Field(ge=1)
    prefix_projection: bool | None = None
    encoder_hidden_size: int | None = Field(default=None, ge=1)


class Oft(_Request):
    """PEFT OFTConfig (method oft); None: PEFT's default."""

    r: int | None = Field(default=None, ge=0)
    oft_block_size: int | None = Field(default=None, ge=0)
    module_dropout: float | None = Field(default=None, ge=0.0, lt=1.0)
    target_modules: Literal["all-linear"] | list[str] | None = None
    coft: bool | None = None
    eps: float | None = Field(default=None, ge=0.0)
    block_share: bool | None = None
    use_cayley_neumann: bool | None = None
    num_cayley_neumann_terms: int | None = Field(default=None, ge=1)


class Quantization(_Request):
    """The frozen base's quantization (QLoRA): bitsandbytes', GPTQ, AWQ, HQQ or torchao."""

    type: QuantTypeName | None = None
    double_quant: bool | None = None
    compute_dtype: DTypeName | None = None
    prepare_kbit: bool | None = None
    bits: int | None = Field(default=None, ge=1, le=8)  # GPTQ/AWQ bits, HQQ nbits
    group_size: int | None = Field(default=None, ge=-1)  # GPTQ/AWQ/HQQ
    desc_act: bool | None = None  # GPTQ act-order


class Parallel(_Request):
    gpus: int | None = Field(default=None, ge=1)
    strategy: StrategyName | None = None
    offload: OffloadName | None = None
    gpus_per_node: int | None = Field(default=None, ge=1)
    bucket_cap_mb: int | None = Field(default=None, ge=1)
    gradient_as_bucket_view: bool | None = None
    sharding_strategy: FsdpShardingName | None = None
    use_orig_params: bool | None = None
    limit_all_gathers: bool | None = None
    forward_prefetch: bool | None = None
    backward_prefetch: FsdpBackwardPrefetchName | None = None
    reshard_after_forward: bool | None = None
    reduce_bucket_size: int | None = Field(default=None, ge=1)
    allgather_bucket_size: int | None = Field(default=None, ge=1)
    stage3_prefetch_bucket_size: int | None = Field(default=None, ge=1)
    stage3_max_live_parameters: int | None = Field(default=None, ge=1)
    stage3_param_persistence_threshold: int | None = Field(default=None, ge=0)
    contiguous_gradients: bool | None = None
    overlap_comm: bool | None = None
    # A DeepSpeed config JSON, or HF Trainer's / accelerate's fsdp_config, as written.
    deepspeed_config: dict[str, Any] | None = None
    fsdp_config: dict[str, Any] | None = None


class Dpo(_Request):
    """TRL DPOConfig's settings that change memory (objective 'dpo' only)."""

    precompute_ref_log_probs: bool | None = None
    # Completion tokens of each sequence; None: the whole sequence.
    max_completion_length: int | None = Field(default=None, ge=1)


class Kto(_Request):
    """TRL KTOConfig's settings that change memory (objective 'kto' only)."""

    precompute_ref_log_probs: bool | None = None
    # 'kto' runs the KL batch (and needs batch_size >= 2); 'apo_zero_unpaired' runs none
    loss_type: Literal["kto", "apo_zero_unpaired"] | None = None


class Grpo(_Request):
    """TRL GRPOConfig's settings that change memory (objective 'grpo' only); the job's
    batch_size counts completions, its seq_len is prompt + completion tokens."""

    num_generations: int | None = Field(default=None, ge=1)
    max_prompt_length: int | None = Field(default=None, ge=1)
    max_completion_length: int | None = Field(default=None, ge=1)
    beta: float | None = Field(default=None, ge=0.0)
    num_iterations: int | None = Field(default=None, ge=1)
    use_vllm: bool | None = None


class Orpo(_Request):
    """TRL ORPOConfig's settings that change memory (objective 'orpo' only)."""

    # False keeps LoRA's dropout (ORPOConfig's default True sets every dropout's p to 0)
    disable_dropout: bool | None = None


class Vision(_Request):
    """A vision-language job's images: per sample, all of one size. Qwen2-VL / Qwen2.5-VL:
    seq_len counts their tokens; give image_height and image_width, or image_tokens.
    Llama-3.2-Vision: give image_height and image_width (the processor's tiles); seq_len
    counts text tokens only."""

    images_per_sample: int | None = Field(default=None, ge=1)
    image_height: int | None = Field(default=None, ge=1)
    image_width: int | None = Field(default=None, ge=1)
    image_tokens: int | None = Field(default=None, ge=1)
    min_pixels: int | None = Field(default=None, ge=1)
    max_pixels: int | None = Field(default=None, ge=1)


class Stack(_Request):
    """The library versions a job runs on; None: the service's traced stack's."""

    transformers: str | None = None
    peft: str | None = None
    bitsandbytes: str | None = None
    torch: str | None = None


class Job(_Request):
    """A fine-tuning job, as POST /v1/estimates takes it; None: the service's default."""

    model: str | ModelRef
    batch_size: int = Field(ge=1)
    seq_len: int = Field(ge=1)
    method: MethodName | None = None
    # 'dpo': batch_size pairs run as 2 x batch_size sequences, with a reference model;
    # 'reward': a one-label reward model, batch_size pairs as 2 x batch_size sequences;
    # 'kto': batch_size unpaired examples, a KL batch and a reference model;
    # 'orpo': batch_size pairs as 2 x batch_size sequences, the whole logits kept, no reference
    objective: ObjectiveName | None = None
    dpo: Dpo | None = None
    kto: Kto | None = None
    grpo: Grpo | None = None
    orpo: Orpo | None = None
    lora: Lora | None = None
    quantization: Quantization | None = None
    vera: Vera | None = None
    loha: Loha | None = None
    lokr: Lokr | None = None
    adalora: AdaLora | None = None
    oft: Oft | None = None
    boft: Boft | None = None
    prefix_tuning: PrefixTuning | None = None
    dtype: DTypeName | None = None
    autocast: bool | None = None
    optim: OptimName | None = None
    gradient_accumulation_steps: int | None = Field(default=None, ge=1)
    max_grad_norm: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    gradient_checkpointing: bool | None = None
    optimizer_in_backward: bool | None = None  # torchtune's optimizer_in_bwd
    activation_offloading: bool | None = None  # torchtune's enable_activation_offloading
    attn_implementation: AttnImplName | None = None
    sdpa_kernel: SdpaKernelName | None = None
    loss: LossName | None = None
    framework: FrameworkName | None = None
    # TRL's padding-free packing: the micro-batch's sequences run as one row.
    packing: bool | None = None
    # TrainingArguments.torch_compile: the service estimates the eager step and says so.
    torch_compile: bool | None = None
    # TrainingArguments.use_liger_kernel: Liger's patches, its fused loss among them.
    liger_kernel: bool | None = None
    parallel: Parallel | None = None
    # An encoder's (BERT) sequence-classification classes; refused for decoder LMs.
    num_labels: int | None = Field(default=None, ge=1)
    # An encoder-decoder's (T5) decoder tokens; seq_len is then the source's.
    target_length: int | None = Field(default=None, ge=1)
    # A vision-language model's image inputs; required for one, refused for others.
    vision: Vision | None = None
    gpu: str | GpuRef | None = None
    # A preset ('hf-5.24', 'hf-4.48', 'hf-4.16') or the versions.
    stack: str | Stack | None = None


class GpuOffer(_Request):
    """A GPU type for a fit-check: by name or by memory, how many, and what one costs."""

    name: str | None = None
    memory_mib: int | None = Field(default=None, ge=1)
    count: int | None = Field(default=None, ge=1)
    price_per_hour: float | None = Field(default=None, ge=0.0)


class PlacementRequest(_Request):
    """Ask a fit-check for the fewest GPUs per GPU type and strategy (null: the service's
    defaults: the job's strategy, up to 64 GPUs, the job's node size or 8)."""

    strategies: list[StrategyName] | None = Field(default=None, min_length=1)
    max_gpus: int | None = Field(default=None, ge=1)
    gpus_per_node: int | None = Field(default=None, ge=1)


class UploadGpu(_Request):
    name: str = Field(min_length=1, description="The name the driver reports.")
    memory_total_bytes: int = Field(gt=0, description="Total memory the driver reports.")


class MeasuredPeaks(_Request):
    """Peaks one rank measured, bytes; a level that was not measured is None."""

    allocated_bytes: int | None = Field(default=None, gt=0)
    reserved_bytes: int | None = Field(default=None, gt=0)
    device_bytes: int | None = Field(default=None, gt=0)


class Environment(_Request):
    """The software a peak was measured with; None: not known on this node."""

    torch: str | None = None
    cuda: str | None = None
    driver: str | None = None
    transformers: str | None = None
    peft: str | None = None
    bitsandbytes: str | None = None
    world_size: int | None = Field(default=None, ge=1)


class CalibrationUpload(_Request):
    """POST /v1/calibrations: one rank's measured peaks for a job, and where they came from."""

    job: Job
    gpu: UploadGpu
    measured: MeasuredPeaks
    outcome: OutcomeName
    environment: Environment
    node_id: str = Field(min_length=1, max_length=200)
    run_id: str = Field(min_length=1, max_length=200)


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
