"""The training-job spec: what the estimator is asked about, with HF Trainer + PEFT defaults.

Field names follow the ecosystem (PEFT's `r`, `lora_alpha`, `target_modules`; HF
TrainingArguments' `optim`, `gradient_checkpointing`; transformers' `attn_implementation`).
Fields left as `None` take the framework preset's default, resolved by `resolve()`.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field
from typing import Any

import service.core.quant_formats as quant_formats
import service.core.spec.parallel as spec_parallel
from service.core.allocator import DEFAULT_ALLOCATOR, AllocatorConfig
from service.core.errors import InvalidSpecError
from service.core.fields import job_field
from service.core.limits import (
    MAX_BATCH_SIZE,
    MAX_GRAD_NORM,
    MAX_GRADIENT_ACCUMULATION,
    MAX_NUM_LABELS,
    MAX_SEQ_LEN,
)
from service.core.spec.checks import (
    check_adapter_method,
    check_liger_job,
    check_lora_fa,
    check_packed_base,
)
from service.core.spec.choices import ADAPTER_METHODS as ADAPTER_METHODS
from service.core.spec.choices import DDP_OBJECTIVES as DDP_OBJECTIVES
from service.core.spec.choices import DELTA_OPTIONS as DELTA_OPTIONS
from service.core.spec.choices import DPO_METHODS as DPO_METHODS
from service.core.spec.choices import LORA_METHODS as LORA_METHODS
from service.core.spec.choices import METHOD_OPTIONS as METHOD_OPTIONS
from service.core.spec.choices import PREFERENCE_OBJECTIVES as PREFERENCE_OBJECTIVES
from service.core.spec.choices import UNMODELLED_OBJECTIVES as UNMODELLED_OBJECTIVES
from service.core.spec.choices import AttnImpl as AttnImpl
from service.core.spec.choices import Framework as Framework
from service.core.spec.choices import LossImpl as LossImpl
from service.core.spec.choices import Method as Method
from service.core.spec.choices import Objective as Objective
from service.core.spec.choices import Optim as Optim
from service.core.spec.choices import SdpaKernel as SdpaKernel
from service.core.spec.choices import objective_from as objective_from
from service.core.spec.delta import (
    DELTA_DEFAULTS,
    AdaLoraSpec,
    BoftSpec,
    DeltaSpec,
    LohaSpec,
    LokrSpec,
    OftSpec,
    VeraSpec,
)
from service.core.spec.dpo import DpoSpec as DpoSpec  # re-exported: the spec's type
from service.core.spec.grpo import GrpoSpec, check_grpo
from service.core.spec.kto import KtoSpec
from service.core.spec.lora import ALL_LINEAR as ALL_LINEAR
from service.core.spec.lora import SAVABLE_MODULES as SAVABLE_MODULES
from service.core.spec.lora import LoraSpec as LoraSpec
from service.core.spec.lora import QuantSpec as QuantSpec
from service.core.spec.lora import QuantType as QuantType
from service.core.spec.orpo import OrpoSpec, orpo_refusal
from service.core.spec.packing import check_packing
from service.core.spec.prompt import (
    IA3Spec,
    LnTuningSpec,
    PrefixTuningSpec,
    PromptTuningSpec,
    check_prompt_job,
)
from service.core.spec.train import check_training_features
from service.core.spec.vision import VisionInputs, check_vision
from service.core.stack import PINNED_STACK, Stack
from service.core.units import DType

# The parallel settings' types and defaults (spec/parallel.py), importable from here as the
# rest of the spec.
DDP_BUCKET_CAP_MB = spec_parallel.DDP_BUCKET_CAP_MB
DEFAULT_GPUS_PER_NODE = spec_parallel.DEFAULT_GPUS_PER_NODE
SHARDING_STRATEGIES = spec_parallel.SHARDING_STRATEGIES
ZERO3_MAX_LIVE_PARAMETERS = spec_parallel.ZERO3_MAX_LIVE_PARAMETERS
ZERO3_PARAM_PERSISTENCE_THRESHOLD = spec_parallel.ZERO3_PARAM_PERSISTENCE_THRESHOLD
ZERO3_PREFETCH_BUCKET_SIZE = spec_parallel.ZERO3_PREFETCH_BUCKET_SIZE
ZERO_ALLGATHER_BUCKET_SIZE = spec_parallel.ZERO_ALLGATHER_BUCKET_SIZE
ZERO_REDUCE_BUCKET_SIZE = spec_parallel.ZERO_REDUCE_BUCKET_SIZE
ZERO_STAGES = spec_parallel.ZERO_STAGES
FsdpBackwardPrefetch = spec_parallel.FsdpBackwardPrefetch
FsdpSharding = spec_parallel.FsdpSharding
Offload = spec_parallel.Offload
ParallelSpec = spec_parallel.ParallelSpec
Strategy = spec_parallel.Strategy


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingSpec:
    """One fine-tuning job on one GPU type. Sizes are per micro-batch, per GPU."""

    method: Method = job_field(
        Method.LORA,
        doc="full, lora, qlora, lora-fa (LoRA with A frozen, PEFT's LoRA-FA optimizer), PEFT's "
        "ia3, ln-tuning, prompt-tuning, prefix-tuning, vera, loha, lokr, adalora, oft or "
        "boft, or LitGPT's llama-adapter or llama-adapter-v2 (framework 'litgpt' only).",
    )
    batch_size: int = job_field(doc="Micro-batch per GPU.", ge=1, le=MAX_BATCH_SIZE)
    seq_len: int = job_field(doc="Tokens per sequence.", ge=1, le=MAX_SEQ_LEN)
    lora: LoraSpec | None = job_field(
        None,
        doc="LoRA options (lora, qlora, lora-fa); null: PEFT's defaults.",
    )
    quantization: QuantSpec | None = job_field(
        None,
        doc="Quantization (qlora, or a 4-bit base under LitGPT's adapters); null: NF4 with "
        "kbit preparation for qlora, an unquantized base for the adapters.",
    )
    # PEFT's other methods' options, each for its method only (`METHOD_OPTIONS`)
    ia3: IA3Spec | None = job_field(
        None, doc="(IA)^3 options (ia3 only); null: PEFT's defaults.", omit="none"
    )
    ln_tuning: LnTuningSpec | None = job_field(
        None, doc="LN tuning options (ln-tuning only); null: PEFT's defaults.", omit="none"
    )
    prompt_tuning: PromptTuningSpec | None = job_field(
        None, doc="Prompt tuning options (prompt-tuning only, required there).", omit="none"
    )
    prefix_tuning: PrefixTuningSpec | None = job_field(
        None, doc="Prefix tuning options (prefix-tuning only, required there).", omit="none"
    )
    dtype: DType = job_field(
        DType.BF16, doc="torch_dtype the base is loaded in.", mirrors="torch_dtype"
    )
    autocast: bool = job_field(
        False,
        doc="TrainingArguments bf16/fp16 autocast.",
        mirrors="TrainingArguments.bf16 / fp16",
    )
    optim: Optim = job_field(
        Optim.ADAMW_TORCH_FUSED,
        doc="TrainingArguments.optim.",
        mirrors="TrainingArguments.optim",
    )
    gradient_accumulation_steps: int = job_field(
        1,
        doc="Micro-batches per step.",
        mirrors="TrainingArguments.gradient_accumulation_steps",
        ge=1,
        le=MAX_GRADIENT_ACCUMULATION,
    )
    # HF Trainer clips the gradients' norm before each optimizer step unless it is 0.
    max_grad_norm: float = job_field(
        1.0,
        doc="TrainingArguments.max_grad_norm: gradient clipping, 0 for none.",
        mirrors="TrainingArguments.max_grad_norm",
        ge=0,
        le=MAX_GRAD_NORM,
        finite=True,
    )
    gradient_checkpointing: bool = job_field(
        False,
        doc="TrainingArguments.gradient_checkpointing.",
        mirrors="TrainingArguments.gradient_checkpointing",
    )
    # (spec/train.py)
    optimizer_in_backward: bool = job_field(
        False,
        doc="torchtune's optimizer_in_bwd (framework 'torchtune', full fine-tuning, one GPU, "
        "no accumulation or clipping): each parameter stepped as its gradient lands.",
        mirrors="torchtune optimizer_in_bwd",
        omit="off",
    )
    activation_offloading: bool = job_field(
        False,
        doc="torchtune's enable_activation_offloading (framework 'torchtune', with "
        "gradient_checkpointing): saved activations kept in pinned host memory.",
        mirrors="torchtune enable_activation_offloading",
        omit="off",
    )
    attn_implementation: AttnImpl = job_field(
        AttnImpl.SDPA,
        doc="transformers attn_implementation.",
        mirrors="from_pretrained(attn_implementation=...)",
    )
    sdpa_kernel: SdpaKernel = job_field(
        SdpaKernel.AUTO, doc="Which SDPA backend runs; auto: PyTorch's pick."
    )
    loss: LossImpl | None = job_field(
        None, doc="Causal-LM loss implementation; null: the framework's."
    )
    framework: Framework = job_field(Framework.HF, doc="Training framework preset.")
    parallel: ParallelSpec = job_field(
        doc="Multi-GPU layout; default one GPU.", factory=ParallelSpec
    )
    allocator: AllocatorConfig = job_field(
        DEFAULT_ALLOCATOR,
        doc="PYTORCH_CUDA_ALLOC_CONF settings; default: PyTorch's.",
        mirrors="PYTORCH_CUDA_ALLOC_CONF",
    )
    # Decoders take none; None: transformers' PreTrainedConfig default, 2.
    num_labels: int | None = job_field(
        None,
        doc="Classes of an encoder's sequence-classification head (BERT); null: the model's, "
        "2 by default. Encoder models only.",
        mirrors="config.num_labels",
        ge=1,
        le=MAX_NUM_LABELS,
        omit="none",
    )
    # Decoder-only and encoder-only models take none.
    target_length: int | None = job_field(
        None,
        doc="An encoder-decoder's (T5) target length: the decoder's tokens (the labels); "
        "seq_len is then the encoder's (the source's). null: as long as seq_len. "
        "Encoder-decoder models only.",
        ge=1,
        le=MAX_SEQ_LEN,
        omit="none",
    )
    stack: Stack = job_field(
        PINNED_STACK,
        doc="The library versions it runs on: a preset ('hf-5.24', the traced stack, 'hf-4.48' "
        "or 'hf-4.16') or {transformers, peft, bitsandbytes, torch}. The answer names the "
        "stack it modelled; a job whose memory differs there in a way not modelled is a 422.",
    )
    # Options of the PEFT methods beside LoRA (service/core/spec/delta.py), one per method,
    # named after it; None: PEFT's defaults.
    vera: VeraSpec | None = job_field(
        None, doc="VeRA options (vera only); null: PEFT's defaults.", omit="none"
    )
    loha: LohaSpec | None = job_field(
        None, doc="LoHa options (loha only); null: PEFT's defaults.", omit="none"
    )
    lokr: LokrSpec | None = job_field(
        None, doc="LoKr options (lokr only); null: PEFT's defaults.", omit="none"
    )
    adalora: AdaLoraSpec | None = job_field(
        None, doc="AdaLoRA options (adalora only); null: PEFT's defaults.", omit="none"
    )
    oft: OftSpec | None = job_field(
        None, doc="OFT options (oft only); null: PEFT's defaults.", omit="none"
    )
    boft: BoftSpec | None = job_field(
        None, doc="BOFT options (boft only); null: PEFT's defaults.", omit="none"
    )
    # The training objective (TRL's trainer names); read last, as the API names a bad option
    # before the objective (its objective is a string until to_spec).
    objective: Objective = job_field(
        Objective.SFT,
        doc="The training objective, as TRL names its trainers: sft (the causal-LM loss, "
        "SFTTrainer's and HF Trainer's) or dpo (DPOTrainer: batch_size pairs run as "
        "2 x batch_size sequences of seq_len tokens, a reference model's forward) or "
        "reward (RewardTrainer: a one-label sequence classifier, batch_size pairs run as "
        "2 x batch_size sequences in one forward, no LM head) or kto (KTOTrainer: "
        "batch_size unpaired examples, a KL batch and a reference model's forwards), orpo "
        "(ORPOTrainer: batch_size pairs run as 2 x batch_size sequences with the whole "
        "logits kept, no reference model) or grpo (GRPOTrainer: model.generate's "
        "completions, batch_size of them, then the policy's loss on them). Other trainers "
        "(rloo, cpo, ...) are a 422: not modelled.",
        omit="default",
        read_last=True,
    )
    dpo: DpoSpec | None = job_field(
        None, doc="DPO settings (objective 'dpo' only); null: DPOConfig's.", omit="none"
    )
    kto: KtoSpec | None = job_field(
        None, doc="KTO settings (objective 'kto' only); null: KTOConfig's.", omit="none"
    )
    grpo: GrpoSpec | None = job_field(
        None, doc="GRPO settings (objective 'grpo' only); null: GRPOConfig's.", omit="none"
    )
    orpo: OrpoSpec | None = job_field(
        None, doc="ORPO settings (objective 'orpo' only); null: ORPOConfig's.", omit="none"
    )
    # (spec/vision.py)
    vision: VisionInputs | None = job_field(
        None,
        doc="A vision-language model's image inputs (Qwen2-VL, Qwen2.5-VL: images per sample "
        "and their size or tokens, which seq_len counts; Llama-3.2-Vision: images per sample "
        "and their size, tiled, seq_len counting text only). Required for such a model; "
        "null otherwise.",
        omit="none",
    )
    # (spec/packing.py)
    packing: bool = job_field(
        False,
        doc="TRL's padding-free packing (SFTConfig padding_free=True, or packing=True with its "
        "default 'bfd' strategy): the micro-batch's batch_size sequences of up to seq_len "
        "tokens run as one row of batch_size x seq_len tokens, position_ids restarting at "
        "each. Under SDPA the row gets a block-diagonal mask; flash_attention_2 runs it "
        "varlen. Objective 'sft', framework 'hf', decoder-only models.",
        mirrors="SFTConfig.padding_free",
        omit="off",
    )
    # Not traced: the eager step is estimated (stated in the answer: estimator/peak.py
    # COMPILE_NOTE)
    torch_compile: bool = job_field(
        False,
        doc="TrainingArguments.torch_compile. Not traced: the eager step is estimated, and "
        "the answer says so (inductor usually keeps no more).",
        mirrors="TrainingArguments.torch_compile",
        omit="off",
    )
    # Liger Kernel's patches for the model type (service/core/liger.py)
    liger_kernel: bool = job_field(
        False,
        doc="TrainingArguments.use_liger_kernel: liger-kernel 0.8.2's RoPE, RMSNorm, "
        "SwiGLU/GEGLU, fused linear cross-entropy (loss 'fused'): llama, mistral, qwen2, gemma2.",
        mirrors="TrainingArguments.use_liger_kernel",
        omit="off",
    )
    # The spec's hash, and that of its fields but the shape, made when first asked: a
    # fit-check looks a job up at dozens of shapes (`with_shape` keeps the second).
    _hash: int = field(default=0, init=False, repr=False, compare=False)
    _shape_free_hash: int = field(default=0, init=False, repr=False, compare=False)

    def __hash__(self) -> int:
        if not self._hash:
            object.__setattr__(self, "_hash", hash(_spec_values(self)) or 1)
        return self._hash

    def shape_free_hash(self) -> int:
        """The hash of every field but batch_size and seq_len (`shape_free_fields`)."""
        if not self._shape_free_hash:
            object.__setattr__(self, "_shape_free_hash", hash(shape_free_fields(self)) or 1)
        return self._shape_free_hash

    def _check_objective(self) -> None:
        """TRL's DPO, KTO, ORPO or reward trainer on one GPU (DDP for some), HF + PEFT full, LoRA
        or QLoRA; the padded batch is `batch_size` pairs (KTO: examples) of `seq_len` tokens."""
        for own in ("dpo", "kto", "orpo", "grpo"):  # each objective's settings, for it alone
            if self.objective.value != own and getattr(self, own) is not None:
                raise InvalidSpecError(own, f"{own.upper()} settings need objective {own!r}")
        if self.objective is Objective.SFT:
            return
        name = self.objective.value
        trainer = PREFERENCE_OBJECTIVES[name]
        if self.method not in DPO_METHODS:
            raise InvalidSpecError(
                "method",
                f"objective {name!r} is modelled with methods "
                f"{', '.join(m.value for m in DPO_METHODS)}, not {self.method.value!r}",
            )
        if self.framework is not Framework.HF:
            raise InvalidSpecError(
                "framework", f"objective {name!r} is TRL's {trainer} (framework 'hf')"
            )
        if self.parallel.gpus != 1 and (
            self.parallel.strategy is not Strategy.DDP or self.objective not in DDP_OBJECTIVES
        ):
            where = (
                "on one GPU or under DDP"
                if self.objective in DDP_OBJECTIVES
                else "on one GPU (no parallel strategy)"
            )
            raise InvalidSpecError("parallel.gpus", f"objective {name!r} is modelled {where}")
        if self.objective is Objective.GRPO:
            check_grpo(self)
        if refusal := orpo_refusal(self.objective.value, self.method.value, self.autocast):
            raise refusal
        if self.autocast and self.dtype is DType.FP16:
            why = "under bf16 mixed precision (TRL's default), not fp16 with its gradient scaler"
            raise InvalidSpecError("autocast", f"objective {name!r} is modelled {why}")
        if self.loss is not None:
            how = {"reward": "scores each sequence with a one-output head (no LM head)"}.get(
                name, "scores tokens with TRL's own LM-head loss"
            )
            raise InvalidSpecError("loss", f"objective {name!r} {how}, not a loss choice")
        if self.num_labels is not None:
            raise InvalidSpecError(
                "num_labels",
                f"objective {name!r} is modelled on decoder-only LMs"
                + (" (a reward model has one label)" if self.objective is Objective.REWARD else ""),
            )
        if self.target_length is not None:
            raise InvalidSpecError(
                "target_length", f"objective {name!r} is modelled on decoder-only LMs"
            )
        if self.batch_size < self.min_batch_size:
            # KTOTrainer.__init__ refuses it: the KL batch rotates completions within it
            raise InvalidSpecError(
                "batch_size",
                f"KTO's loss_type {self.kto_settings.loss_type.value!r} needs at least "
                f"{self.min_batch_size} "
                "examples per micro-batch (KTOTrainer: the KL completions are the batch's "
                "own rotated by one)",
            )

    def _check_method_options(self) -> None:
        """Each method's options only with that method, and what the PEFT methods beside LoRA
        are modelled with: PEFT's own step (framework 'hf') on one GPU, without autocast."""
        for method, name in DELTA_OPTIONS.items():
            if getattr(self, name) is not None and self.method is not method:
                raise InvalidSpecError(name, f"{name} options need method {method.value!r}")
        if self.method not in DELTA_OPTIONS:
            return
        label = self.method.value
        if self.framework is not Framework.HF:
            raise InvalidSpecError("framework", f"{label} is modelled as PEFT's (framework 'hf')")
        if self.autocast:
            raise InvalidSpecError("autocast", f"{label} under mixed precision is not modelled")
        if self.parallel.gpus != 1:
            raise InvalidSpecError("parallel.gpus", f"{label} is modelled on one GPU")

    def __post_init__(self) -> None:
        if self.packing:
            check_packing(
                objective=self.objective.value,
                method=self.method.value,
                framework=self.framework.value,
            )
        if self.num_labels is not None and self.num_labels < 1:
            raise InvalidSpecError("num_labels", "must be at least 1")
        if self.target_length is not None and self.target_length < 1:
            raise InvalidSpecError("target_length", "must be at least 1")
        if self.batch_size < 1:
            raise InvalidSpecError("batch_size", "must be at least 1")
        if self.seq_len < 1:
            raise InvalidSpecError("seq_len", "must be at least 1")
        if self.gradient_accumulation_steps < 1:
            raise InvalidSpecError("gradient_accumulation_steps", "must be at least 1")
        if not 0 <= self.max_grad_norm < float("inf"):
            raise InvalidSpecError("max_grad_norm", "must be a finite number, 0 or more")
        if self.method not in LORA_METHODS and self.lora is not None:
            raise InvalidSpecError("lora", "LoRA options need method 'lora', 'qlora' or 'lora-fa'")
        for method, name in METHOD_OPTIONS.items():
            if self.method is not method and getattr(self, name) is not None:
                raise InvalidSpecError(name, f"{name} options need method {method.value!r}")
        if self.method in METHOD_OPTIONS:
            self._check_peft_method()
        if self.method is Method.LORA_FA:
            check_lora_fa(self)
        self._check_method_options()
        self._check_objective()
        check_liger_job(self)
        check_training_features(self)
        check_vision(self)
        if self.method in ADAPTER_METHODS:
            check_adapter_method(self)
        elif self.method is not Method.QLORA and self.quantization is not None:
            raise InvalidSpecError("quantization", "quantization needs method 'qlora'")
        if self.quantization is not None and self.quantization.type.packed:
            check_packed_base(self, self.quantization.type.value)
        if self.lora is not None and self.lora.use_dora and self.framework is not Framework.HF:
            raise InvalidSpecError(
                "lora.use_dora", f"DoRA is modelled as PEFT's, not {self.framework}'s"
            )
        if self.method is Method.QLORA and self.parallel.strategy in SHARDING_STRATEGIES:
            raise InvalidSpecError(
                "parallel.strategy",
                f"QLoRA under {self.parallel.strategy} shards the 4-bit base weights, which "
                "needs bitsandbytes' bnb_4bit_quant_storage set to the compute dtype (PEFT's "
                "FSDP-QLoRA and DeepSpeed ZeRO-3 QLoRA guides); that layout is not modelled: "
                "use ddp, zero1 or zero2",
            )

    def with_shape(self, batch_size: int, seq_len: int) -> TrainingSpec:
        """This job at another micro-batch size and sequence length: what
        `dataclasses.replace(self, batch_size=..., seq_len=...)` gives, made without checking
        again what does not depend on the shape. An SFT job's checks read the shape only in
        its two bounds; the other objectives' (KTO's smallest batch, GRPO's generation batch
        and prompt length) are run again whole. The fit-check and the batch route make dozens
        of shapes of one job per request."""
        if self.objective is not Objective.SFT:
            return dataclasses.replace(self, batch_size=batch_size, seq_len=seq_len)
        if batch_size < 1:
            raise InvalidSpecError("batch_size", "must be at least 1")
        if seq_len < 1:
            raise InvalidSpecError("seq_len", "must be at least 1")
        shaped = object.__new__(TrainingSpec)
        for put, value in zip(_SPEC_SETTERS, _spec_values(self), strict=True):
            put(shaped, value)
        _SPEC_SETTERS[_BATCH_SIZE](shaped, batch_size)
        _SPEC_SETTERS[_SEQ_LEN](shaped, seq_len)
        object.__setattr__(shaped, "_hash", 0)
        object.__setattr__(shaped, "_shape_free_hash", self._shape_free_hash)
        return shaped

    def changed(self, **changes: Any) -> TrainingSpec:
        """`dataclasses.replace(self, **changes)` without the dataclass's `__init__`, checked
        the same way (a fit-check changes its job a dozen times a request)."""
        values = list(_spec_values(self))
        for name, value in changes.items():
            values[_SPEC_INDEX[name]] = value  # KeyError: no such field
        made = object.__new__(TrainingSpec)
        for put, value in zip(_SPEC_SETTERS, values, strict=True):
            put(made, value)
        object.__setattr__(made, "_hash", 0)
        object.__setattr__(made, "_shape_free_hash", 0)
        made.__post_init__()
        return made

    @property
    def min_batch_size(self) -> int:
        """The smallest micro-batch the objective's trainer runs (KTO's KL batch needs two)."""
        return self.kto_settings.min_batch_size if self.objective is Objective.KTO else 1

    @property
    def grpo_settings(self) -> GrpoSpec:
        """GRPO's settings, GRPOConfig's defaults where none are given."""
        return self.grpo or GrpoSpec()

    @property
    def kto_settings(self) -> KtoSpec:
        """KTO's settings, KTOConfig's defaults where none are given."""
        return self.kto or KtoSpec()

    @property
    def orpo_settings(self) -> OrpoSpec:
        """ORPO's settings, ORPOConfig's defaults where none are given."""
        return self.orpo or OrpoSpec()

    @property
    def dpo_settings(self) -> DpoSpec:
        """DPO's settings, DPOConfig's defaults where none are given."""
        return self.dpo or DpoSpec()

    @property
    def kbit_base(self) -> bool:
        """Whether the frozen base weights are quantized (QLoRA, or a LitGPT adapter over a
        4-bit base)."""
        return self.method is Method.QLORA or (
            self.method in ADAPTER_METHODS and self.quantization is not None
        )

    def _check_peft_method(self) -> None:
        """PEFT's other methods: HF + PEFT on one GPU, unquantized, without autocast."""
        method = self.method.value
        if self.quantization is not None:
            raise InvalidSpecError(
                "quantization", f"a quantized base is not modelled for method {method!r}"
            )
        if self.framework is not Framework.HF:
            raise InvalidSpecError("framework", f"method {method!r} is modelled as PEFT's")
        if self.parallel.gpus != 1:
            raise InvalidSpecError("parallel.gpus", f"method {method!r} is modelled on one GPU")
        if self.autocast:
            raise InvalidSpecError("autocast", f"method {method!r} is modelled without autocast")
        check_prompt_job(self.method.value, self, self.gradient_checkpointing)


# TrainingSpec's fields in order, a getter of their values and their slots' setters (which a
# frozen dataclass's own __init__ reaches through object.__setattr__): `TrainingSpec.with_shape`.
_SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(TrainingSpec) if f.init)
_spec_values = operator.attrgetter(*_SPEC_FIELDS)
# A job's fields but its shape, in order: equal for two shapes of one job.
shape_free_fields = operator.attrgetter(
    *(name for name in _SPEC_FIELDS if name not in ("batch_size", "seq_len"))
)
_SPEC_SETTERS = tuple(TrainingSpec.__dict__[name].__set__ for name in _SPEC_FIELDS)
_SPEC_INDEX = {name: index for index, name in enumerate(_SPEC_FIELDS)}
_BATCH_SIZE = _SPEC_FIELDS.index("batch_size")
_SEQ_LEN = _SPEC_FIELDS.index("seq_len")


@dataclass(frozen=True, slots=True, kw_only=True)
class ResolvedSpec:
    """A spec with every preset default filled in, plus the assumptions that filled them."""

    spec: TrainingSpec
    lora: LoraSpec | None
    quantization: QuantSpec | None
    ia3: IA3Spec | None
    ln_tuning: LnTuningSpec | None
    prompt_tuning: PromptTuningSpec | None
    adapter_dtype: DType
    lora_dropout: float
    compute_dtype: DType
    loss: LossImpl
    assumptions: tuple[str, ...]
    # The method's adapter options (VeRA's beside the LoRA-shaped placement `lora` resolve()
    # derives from them), and the request field their errors name.
    vera: VeraSpec | None = None
    loha: LohaSpec | None = None
    lokr: LokrSpec | None = None
    adalora: AdaLoraSpec | None = None
    oft: OftSpec | None = None
    boft: BoftSpec | None = None
    options_field: str = "lora"


# LitGPT finetune/lora.py: lora_dropout default 0.05.
LITGPT_LORA_DROPOUT = 0.05


def resolve(spec: TrainingSpec) -> ResolvedSpec:
    """Fill the framework preset's defaults, recording each as a plain-words assumption.

    HF Trainer + PEFT: fp32 adapters (PEFT autocast_adapter_dtype=True), HF's fp32-upcast loss.
    LitGPT: `--precision bf16-true` converts the whole model, adapters included, to bf16, and
      the finetune scripts use a chunked lm_head + cross-entropy.
    torchtune: adapters take the model dtype (bf16 recipes), and its recipes use
      CEWithChunkedOutputLoss (8 chunks, each upcast to fp32).
    """
    notes: list[str] = []
    delta, lora = _resolve_delta(spec, notes)
    quant = _resolve_quantization(spec, notes)
    ia3 = spec.ia3
    if spec.method is Method.IA3 and ia3 is None:
        ia3 = IA3Spec()
        notes.append("IA3 options not given: PEFT's default target and feedforward modules")
    ln_tuning = spec.ln_tuning
    if spec.method is Method.LN_TUNING and ln_tuning is None:
        ln_tuning = LnTuningSpec()
        notes.append("LN tuning options not given: PEFT's default target modules")
    adapter_dtype = _adapter_dtype(spec, lora, ia3, notes)

    if lora is not None and lora.lora_dropout is not None:
        lora_dropout = lora.lora_dropout
    elif spec.framework is Framework.LITGPT:
        lora_dropout = LITGPT_LORA_DROPOUT
        if lora is not None:
            notes.append(f"LoRA dropout {LITGPT_LORA_DROPOUT} (LitGPT's finetune default)")
    else:
        lora_dropout = 0.0

    if quant is not None and quant.compute_dtype is not None:
        compute_dtype = quant.compute_dtype
    else:
        compute_dtype = spec.dtype
    loss = _loss(spec, notes)

    return ResolvedSpec(
        spec=spec,
        lora=lora,
        quantization=quant,
        ia3=ia3,
        ln_tuning=ln_tuning,
        prompt_tuning=spec.prompt_tuning,
        adapter_dtype=adapter_dtype,
        lora_dropout=lora_dropout,
        compute_dtype=compute_dtype,
        loss=loss,
        assumptions=tuple(notes),
        vera=delta if isinstance(delta, VeraSpec) else None,
        loha=delta if isinstance(delta, LohaSpec) else None,
        lokr=delta if isinstance(delta, LokrSpec) else None,
        adalora=delta if isinstance(delta, AdaLoraSpec) else None,
        oft=delta if isinstance(delta, OftSpec) else None,
        boft=delta if isinstance(delta, BoftSpec) else None,
        options_field=DELTA_OPTIONS.get(spec.method, "lora"),
    )


def _resolve_delta(
    spec: TrainingSpec, notes: list[str]
) -> tuple[DeltaSpec | None, LoraSpec | None]:
    """VeRA, LoHa, LoKr, AdaLoRA, OFT and BOFT: their options (defaults where none are given),
    and the linears they adapt and their rank in LoRA's terms (`adapted_linears`); the LoRA
    options of a LoRA method (PEFT's defaults where none are given)."""
    lora = spec.lora
    delta: DeltaSpec | None = None
    field_name = DELTA_OPTIONS.get(spec.method)
    if field_name is not None:
        given = getattr(spec, field_name)
        default, note = DELTA_DEFAULTS[field_name]
        delta = given or default()
        if given is None:
            notes.append(note)
        # (OFT's rank counts blocks; an OFT job's LoRA-shaped placement takes its targets alone)
        rank = max(delta.r, 1)
        lora = LoraSpec(r=rank, target_modules=delta.target_modules, adapter_dtype=DType.FP32)
    if (spec.method in LORA_METHODS or spec.method in DELTA_OPTIONS) and lora is None:
        lora = LoraSpec()
        notes.append("LoRA options not given: r=8, lora_alpha=8, default target modules")
    return delta, lora


def _resolve_quantization(spec: TrainingSpec, notes: list[str]) -> QuantSpec | None:
    """The base's quantization (QLoRA's default where none is given), with kbit preparation as
    the framework and the format run it."""
    quant = spec.quantization
    if spec.method is Method.QLORA and quant is None:
        quant = QuantSpec()
        notes.append(
            "quantization not given: NF4 without double quant"
            + (", kbit preparation on" if spec.framework is Framework.HF else "")
        )
    if quant is not None and quant.prepare_kbit and spec.framework is not Framework.HF:
        # LitGPT's finetune scripts quantize through Fabric's BitsandbytesPrecision and
        # torchtune's recipes through torchao: neither runs PEFT's
        # prepare_model_for_kbit_training, so no norm or embedding is cast to fp32.
        quant = dataclasses.replace(quant, prepare_kbit=False)
        notes.append(
            f"{spec.framework} does not run PEFT's kbit preparation: norms and embeddings keep "
            "the model dtype"
        )
    if quant is not None and quant.type.packed:
        if quant.prepare_kbit and quant.type is not QuantType.AWQ:
            # prepare_model_for_kbit_training casts nothing to fp32 on a GPTQ, HQQ or torchao
            # model (peft/utils/other.py: is_gptq_quantized / is_hqq_quantized /
            # is_torchao_quantized skip the cast); an AWQ model ("awq") is not excluded.
            quant = dataclasses.replace(quant, prepare_kbit=False)
            notes.append(
                f"PEFT's kbit preparation leaves a {quant.type} model's norms and embeddings "
                "in the model dtype"
            )
        notes.append(
            quant_formats.format_note(
                quant.type.value, quant.resolved_bits, quant.resolved_group_size
            )
        )
    return quant


def _adapter_dtype(
    spec: TrainingSpec, lora: LoraSpec | None, ia3: IA3Spec | None, notes: list[str]
) -> DType:
    """The trained adapters' dtype: as given, else as the method and the framework make it."""
    if lora is not None and lora.adapter_dtype is not None:
        return lora.adapter_dtype
    if spec.method in (Method.PROMPT_TUNING, Method.PREFIX_TUNING):
        # PromptEmbedding's and PrefixEncoder's modules are built in torch's default dtype,
        # fp32, and cast_adapter_dtype leaves them (peft/tuners/prompt_tuning/model.py)
        return DType.FP32
    if spec.method is Method.LN_TUNING:
        # LN tuning's trainable norms are deep copies of the model's (peft/tuners/ln_tuning/
        # layer.py update_layer); PEFT's cast_adapter_dtype casts adapter parameters only, not
        # the modules a ModuleDict holds, so they keep the model's dtype.
        return spec.dtype
    if spec.framework is Framework.HF:
        if lora is not None or ia3 is not None:
            notes.append("adapters in fp32 (PEFT autocast_adapter_dtype=True, the default)")
        return DType.FP32
    if lora is not None:
        notes.append(f"adapters in {spec.dtype} ({spec.framework} keeps the model dtype)")
    return spec.dtype


def _loss(spec: TrainingSpec, notes: list[str]) -> LossImpl:
    """The causal-LM loss: Liger's fused one, as given, or the framework's."""
    if spec.liger_kernel:
        if spec.loss is None:
            notes.append("use_liger_kernel: Liger's fused linear cross-entropy, no logits")
        return LossImpl.FUSED
    if spec.loss is not None:
        return spec.loss
    if spec.framework is Framework.HF:
        return LossImpl.HF
    notes.append(f"{spec.framework} computes lm_head and cross-entropy in chunks")
    return LossImpl.CHUNKED
