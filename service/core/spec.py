"""The training-job spec: what the estimator is asked about, with HF Trainer + PEFT defaults.

Field names follow the ecosystem (PEFT's `r`, `lora_alpha`, `target_modules`; HF
TrainingArguments' `optim`, `gradient_checkpointing`; transformers' `attn_implementation`).
Fields left as `None` take the framework preset's default, resolved by `resolve()`.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import service.core.quant_formats as quant_formats
import service.core.spec_parallel as spec_parallel
from service.core.allocator import DEFAULT_ALLOCATOR, AllocatorConfig
from service.core.errors import InvalidSpecError
from service.core.spec_checks import (
    check_adapter_method,
    check_liger_job,
    check_lora_fa,
    check_packed_base,
)
from service.core.spec_delta import (
    DELTA_DEFAULTS,
    AdaLoraSpec,
    BoftSpec,
    DeltaSpec,
    LohaSpec,
    LokrSpec,
    OftSpec,
    VeraSpec,
)
from service.core.spec_dpo import DpoSpec as DpoSpec  # re-exported: the spec's type
from service.core.spec_grpo import GrpoSpec, check_grpo
from service.core.spec_kto import KtoSpec
from service.core.spec_orpo import OrpoSpec, orpo_refusal
from service.core.spec_packing import check_packing
from service.core.spec_prompt import (
    IA3Spec,
    LnTuningSpec,
    PrefixTuningSpec,
    PromptTuningSpec,
    check_prompt_job,
)
from service.core.spec_train import check_training_features
from service.core.spec_vision import VisionInputs, check_vision
from service.core.stack import PINNED_STACK, Stack
from service.core.units import DType

# The parallel settings' types and defaults (spec_parallel.py), importable from here as the
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


class Method(StrEnum):
    FULL = "full"
    LORA = "lora"
    QLORA = "qlora"
    # LoRA with A frozen, B trained by PEFT's LoraFAOptimizer (peft/optimizers/lorafa.py).
    LORA_FA = "lora-fa"
    # VeRA: frozen shared random projections, trained scaling vectors (peft/tuners/vera).
    VERA = "vera"
    # LoHa: a Hadamard product of two low-rank pairs as a full-size delta (peft/tuners/loha).
    LOHA = "loha"
    # LoKr: a Kronecker product as a full-size delta (peft/tuners/lokr).
    LOKR = "lokr"
    # AdaLoRA: SVD-shaped LoRA triplets, an orthogonality penalty, a rank allocator (peft/tuners/
    # adalora).
    ADALORA = "adalora"
    # OFT: block-diagonal orthogonal rotations of each adapted linear's input (peft/tuners/oft).
    OFT = "oft"
    # BOFT: OFT's butterfly generalisation, a dense rotation of the input (peft/tuners/boft).
    BOFT = "boft"
    IA3 = "ia3"
    LN_TUNING = "ln-tuning"
    PROMPT_TUNING = "prompt-tuning"
    PREFIX_TUNING = "prefix-tuning"
    LLAMA_ADAPTER = "llama-adapter"
    LLAMA_ADAPTER_V2 = "llama-adapter-v2"


# PEFT's prompt-side methods, each with the TrainingSpec field that holds its options
# (service/core/spec_prompt.py); the weight-side ones are `DELTA_OPTIONS`.
METHOD_OPTIONS = {
    Method.IA3: "ia3",
    Method.LN_TUNING: "ln_tuning",
    Method.PROMPT_TUNING: "prompt_tuning",
    Method.PREFIX_TUNING: "prefix_tuning",
}
# LitGPT's LLaMA-Adapter and LLaMA-Adapter v2 (lit_gpt/adapter.py, lit_gpt/adapter_v2.py): no
# options of their own (LitGPT's defaults, service/core/estimator/adapter.py); the base may
# be 4-bit (finetune/adapter*.py --quantize bnb.nf4 / bnb.nf4-dq).
ADAPTER_METHODS = (Method.LLAMA_ADAPTER, Method.LLAMA_ADAPTER_V2)


class Objective(StrEnum):
    """The training loss, named as TRL names its trainers (SFTTrainer, DPOTrainer, ...)."""

    SFT = "sft"  # the causal-LM loss of HF Trainer (SFTTrainer's)
    DPO = "dpo"  # direct preference optimization (trl/trainer/dpo_trainer.py, TRL 1.16.0)
    REWARD = "reward"  # a one-label classifier on [chosen; rejected] (reward_trainer.py)
    KTO = "kto"  # unpaired completions, a KL batch, a reference (kto_trainer.py, TRL 1.16.0)
    # odds-ratio preference optimization: NLL on chosen plus an odds-ratio term, no reference
    # (trl/experimental/orpo/orpo_trainer.py, TRL 1.16.0)
    ORPO = "orpo"
    GRPO = "grpo"  # generated completions, scored (trl/trainer/grpo_trainer.py, TRL 1.16.0)


# TRL's other trainers (trl 1.16.0: trl/trainer/, trl/experimental/), refused with the reason
# rather than as unknown words.
UNMODELLED_OBJECTIVES = {
    "rloo": "RLOOTrainer",
    "cpo": "CPOTrainer",
    "online_dpo": "OnlineDPOTrainer",
    "distillation": "DistillationTrainer",
}
# What TRL's trainers are modelled with: HF + PEFT full, LoRA and QLoRA.
DPO_METHODS = (Method.FULL, Method.LORA, Method.QLORA)
PREFERENCE_OBJECTIVES = {"dpo": "DPOTrainer", "reward": "RewardTrainer", "kto": "KTOTrainer"}
PREFERENCE_OBJECTIVES.update(orpo="ORPOTrainer", grpo="GRPOTrainer")
# The objectives modelled under DDP too: each rank the one-GPU step with DDP's gradient buckets
# (reference traces tests/data/traces_parallel/*__{dpo,reward,kto,orpo}__*__ddp-*).
DDP_OBJECTIVES = frozenset({Objective.DPO, Objective.REWARD, Objective.KTO, Objective.ORPO})


def objective_from(name: str) -> Objective:
    """The objective called `name`, or an error naming the field and why it is refused."""
    try:
        return Objective(name)
    except ValueError:
        modelled = ", ".join(repr(o.value) for o in Objective)
        trainer = UNMODELLED_OBJECTIVES.get(name.lower())
        if trainer is not None:
            reason = f"{name!r} (TRL's {trainer}) is not modelled"
        else:
            reason = f"unknown objective {name!r}"
        raise InvalidSpecError("objective", f"{reason}; modelled: {modelled}") from None


class QuantType(StrEnum):
    """The frozen base's weight format: bitsandbytes' (nf4, fp4, int8) or another library's
    (service/core/quant_formats.py): GPTQ and AWQ through gptqmodel, HQQ, torchao."""

    NF4 = "nf4"
    FP4 = "fp4"
    INT8 = "int8"
    GPTQ = quant_formats.GPTQ
    AWQ = quant_formats.AWQ
    HQQ = quant_formats.HQQ
    TORCHAO_INT4 = quant_formats.TORCHAO_INT4
    TORCHAO_FLOAT8 = quant_formats.TORCHAO_FLOAT8

    @property
    def packed(self) -> bool:
        """A format beside bitsandbytes' (GPTQ, AWQ, HQQ, torchao)."""
        return self.value in quant_formats.PACKED_TYPES


class Optim(StrEnum):
    """Optimizers by their HF `TrainingArguments.optim` names."""

    ADAMW_TORCH = "adamw_torch"
    ADAMW_TORCH_FUSED = "adamw_torch_fused"
    ADAMW_BNB_8BIT = "adamw_bnb_8bit"
    PAGED_ADAMW_8BIT = "paged_adamw_8bit"
    PAGED_ADAMW_32BIT = "paged_adamw_32bit"
    ADAFACTOR = "adafactor"
    SGD = "sgd"


class AttnImpl(StrEnum):
    EAGER = "eager"
    SDPA = "sdpa"
    FLASH_ATTENTION_2 = "flash_attention_2"


class SdpaKernel(StrEnum):
    """Which SDPA backend runs; `auto` is what PyTorch picks on a GPU (flash for bf16/fp16)."""

    AUTO = "auto"
    FLASH = "flash"
    EFFICIENT = "efficient"
    MATH = "math"


class LossImpl(StrEnum):
    """How the causal-LM loss is computed.

    hf: transformers' ForCausalLMLoss, logits upcast to fp32 then cross-entropy.
    plain: cross-entropy on the half-precision logits, no upcast.
    chunked: lm_head + cross-entropy over sequence chunks (LitGPT, torchtune), b*s*V never whole.
    fused: fused linear cross-entropy (Liger, Cut Cross-Entropy), logits never materialised.
    """

    HF = "hf"
    PLAIN = "plain"
    CHUNKED = "chunked"
    FUSED = "fused"


class Framework(StrEnum):
    """Training framework preset; each differs in defaults (see `resolve`)."""

    HF = "hf"
    LITGPT = "litgpt"
    TORCHTUNE = "torchtune"


ALL_LINEAR = "all-linear"
# What `modules_to_save` can name: the input embedding and the LM head, by their module names in
# transformers' decoder models (modeling_llama.py LlamaModel.embed_tokens,
# LlamaForCausalLM.lm_head). PEFT trains a full copy of each (ModulesToSaveWrapper).
SAVABLE_MODULES = ("embed_tokens", "lm_head")
# The methods that take LoRA options (`lora`).
LORA_METHODS = (Method.LORA, Method.QLORA, Method.LORA_FA)
# The PEFT methods beside LoRA with options of their own: the TrainingSpec field of each.
DELTA_OPTIONS = {
    Method.VERA: "vera",
    Method.LOHA: "loha",
    Method.LOKR: "lokr",
    Method.ADALORA: "adalora",
    Method.OFT: "oft",
    Method.BOFT: "boft",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class LoraSpec:
    """PEFT LoraConfig; defaults are PEFT's (peft/tuners/lora/config.py)."""

    r: int = 8
    lora_alpha: int = 8
    # None: the framework's default (PEFT 0.0; LitGPT's finetune scripts 0.05).
    lora_dropout: float | None = None
    # None: PEFT's per-architecture default (q_proj, v_proj for Llama-family models).
    target_modules: tuple[str, ...] | str | None = None
    modules_to_save: tuple[str, ...] = ()
    # None: the framework's default; PEFT's autocast_adapter_dtype=True makes fp32 adapters.
    adapter_dtype: DType | None = None
    # DoRA (peft/tuners/lora/dora.py DoraLinearLayer): a trainable magnitude per output feature
    # of each adapted linear, and a forward that keeps more for backward.
    use_dora: bool = False
    # rsLoRA: scaling lora_alpha / sqrt(r) instead of lora_alpha / r; no tensor changes size.
    use_rslora: bool = False

    def __post_init__(self) -> None:
        if self.r < 1:
            raise InvalidSpecError("lora.r", "must be at least 1")
        if self.lora_dropout is not None and not 0.0 <= self.lora_dropout < 1.0:
            raise InvalidSpecError("lora.lora_dropout", "must be in [0, 1)")
        if isinstance(self.target_modules, str) and self.target_modules != ALL_LINEAR:
            raise InvalidSpecError(
                "lora.target_modules", f"must be a list of module names or {ALL_LINEAR!r}"
            )
        if isinstance(self.target_modules, tuple) and not self.target_modules:
            raise InvalidSpecError("lora.target_modules", "must not be empty")
        unknown = [name for name in self.modules_to_save if name not in SAVABLE_MODULES]
        if unknown:
            raise InvalidSpecError(
                "lora.modules_to_save",
                f"{', '.join(map(repr, unknown))}: only the embedding and the LM head can be "
                f"trained in full beside the adapters ({', '.join(SAVABLE_MODULES)})",
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class QuantSpec:
    """The frozen base's quantization: bitsandbytes' (BitsAndBytesConfig), or GPTQ, AWQ, HQQ
    or torchao (GPTQConfig, AwqConfig, HqqConfig, TorchAoConfig; quant_formats.py)."""

    type: QuantType = QuantType.NF4
    double_quant: bool = False  # bnb_4bit_use_double_quant, BitsAndBytesConfig default False
    # None: the model's dtype (the QLoRA recipe); BitsAndBytesConfig's own default is fp32.
    compute_dtype: DType | None = None
    prepare_kbit: bool = True  # peft.prepare_model_for_kbit_training applied
    # GPTQ/AWQ `bits`, HQQ `nbits`; None: the format's default (quant_formats.DEFAULT_BITS)
    bits: int | None = None
    # GPTQ/AWQ/HQQ `group_size` (-1: one group per input row for GPTQ/AWQ); None: the default
    group_size: int | None = None
    # GPTQConfig.desc_act (act-order: g_idx permutes the groups; the stored tensors are alike)
    desc_act: bool = False

    def __post_init__(self) -> None:
        quant_formats.check_quant_options(
            self.type.value, self.bits, self.group_size, self.desc_act
        )
        if self.type.packed and self.double_quant:
            raise InvalidSpecError("quantization.double_quant", "only for bitsandbytes' nf4/fp4")
        if self.type.packed and self.compute_dtype is not None:
            raise InvalidSpecError(
                "quantization.compute_dtype",
                f"only for bitsandbytes; {self.type.value} computes in the model's dtype",
            )

    @property
    def resolved_bits(self) -> int:
        """The width of a GPTQ, AWQ or HQQ weight (the format's default when not given)."""
        return self.bits or quant_formats.DEFAULT_BITS.get(self.type.value, 0)

    @property
    def resolved_group_size(self) -> int:
        """The group size of a GPTQ, AWQ or HQQ weight (the format's default when not given)."""
        return self.group_size or quant_formats.DEFAULT_GROUP_SIZE.get(self.type.value, 0)


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingSpec:
    """One fine-tuning job on one GPU type. Sizes are per micro-batch, per GPU."""

    method: Method = Method.LORA
    batch_size: int
    seq_len: int
    lora: LoraSpec | None = None
    quantization: QuantSpec | None = None
    # PEFT's other methods' options, each for its method only (`METHOD_OPTIONS`)
    ia3: IA3Spec | None = None
    ln_tuning: LnTuningSpec | None = None
    prompt_tuning: PromptTuningSpec | None = None
    prefix_tuning: PrefixTuningSpec | None = None
    dtype: DType = DType.BF16  # torch_dtype the base model is loaded in
    autocast: bool = False  # TrainingArguments bf16/fp16 mixed precision (default off)
    optim: Optim = Optim.ADAMW_TORCH_FUSED  # TrainingArguments.optim default
    gradient_accumulation_steps: int = 1
    # TrainingArguments.max_grad_norm: HF Trainer clips the gradients' norm before each
    # optimizer step unless it is 0.
    max_grad_norm: float = 1.0
    gradient_checkpointing: bool = False
    optimizer_in_backward: bool = False  # torchtune's optimizer_in_bwd (spec_train.py)
    activation_offloading: bool = False  # torchtune's enable_activation_offloading
    attn_implementation: AttnImpl = AttnImpl.SDPA
    sdpa_kernel: SdpaKernel = SdpaKernel.AUTO
    loss: LossImpl | None = None
    framework: Framework = Framework.HF
    parallel: ParallelSpec = field(default_factory=ParallelSpec)
    allocator: AllocatorConfig = DEFAULT_ALLOCATOR  # PYTORCH_CUDA_ALLOC_CONF
    # Classes of an encoder's sequence-classification head (config.num_labels); None: the
    # model's (transformers' PreTrainedConfig default, 2). Decoders take none.
    num_labels: int | None = None
    # An encoder-decoder's (T5) target length: the decoder's tokens, the labels' length;
    # seq_len is the encoder's (the source's). None: as long as the source. Decoder-only and
    # encoder-only models take none.
    target_length: int | None = None
    stack: Stack = PINNED_STACK  # the library versions the job runs on
    # Options of the PEFT methods beside LoRA (service/core/spec_delta.py), one per method,
    # named after it; None: PEFT's defaults.
    vera: VeraSpec | None = None
    loha: LohaSpec | None = None
    lokr: LokrSpec | None = None
    adalora: AdaLoraSpec | None = None
    oft: OftSpec | None = None
    boft: BoftSpec | None = None
    # The training objective (TRL's trainer names) and DPO's settings, for objective "dpo".
    objective: Objective = Objective.SFT
    dpo: DpoSpec | None = None
    kto: KtoSpec | None = None  # KTOConfig's settings, for objective "kto"
    grpo: GrpoSpec | None = None  # GRPOConfig's settings, for objective "grpo"
    orpo: OrpoSpec | None = None  # ORPOConfig's settings, for objective "orpo"
    vision: VisionInputs | None = None  # a vision-language job's images (spec_vision.py)
    # TRL's padding-free packing (spec_packing.py): the micro-batch's sequences in one row of
    # at most batch_size x seq_len tokens, position_ids restarting at each
    packing: bool = False
    # TrainingArguments.torch_compile: not traced, the eager step is estimated (stated in the
    # answer: estimator/peak.py COMPILE_NOTE)
    torch_compile: bool = False
    # TrainingArguments.use_liger_kernel: Liger Kernel's patches for the model type
    # (service/core/liger.py), its fused linear cross-entropy among them
    liger_kernel: bool = False
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
    lora = spec.lora
    quant = spec.quantization
    # VeRA, LoHa, LoKr and AdaLoRA: their options, and the linears they adapt and their rank
    # in LoRA's terms (`adapted_linears`)
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

    ia3 = spec.ia3
    if spec.method is Method.IA3 and ia3 is None:
        ia3 = IA3Spec()
        notes.append("IA3 options not given: PEFT's default target and feedforward modules")
    ln_tuning = spec.ln_tuning
    if spec.method is Method.LN_TUNING and ln_tuning is None:
        ln_tuning = LnTuningSpec()
        notes.append("LN tuning options not given: PEFT's default target modules")

    if lora is not None and lora.adapter_dtype is not None:
        adapter_dtype = lora.adapter_dtype
    elif spec.method in (Method.PROMPT_TUNING, Method.PREFIX_TUNING):
        # PromptEmbedding's and PrefixEncoder's modules are built in torch's default dtype,
        # fp32, and cast_adapter_dtype leaves them (peft/tuners/prompt_tuning/model.py)
        adapter_dtype = DType.FP32
    elif spec.method is Method.LN_TUNING:
        # LN tuning's trainable norms are deep copies of the model's (peft/tuners/ln_tuning/
        # layer.py update_layer); PEFT's cast_adapter_dtype casts adapter parameters only, not
        # the modules a ModuleDict holds, so they keep the model's dtype.
        adapter_dtype = spec.dtype
    elif spec.framework is Framework.HF:
        adapter_dtype = DType.FP32
        if lora is not None or ia3 is not None:
            notes.append("adapters in fp32 (PEFT autocast_adapter_dtype=True, the default)")
    else:
        adapter_dtype = spec.dtype
        if lora is not None:
            notes.append(f"adapters in {spec.dtype} ({spec.framework} keeps the model dtype)")

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

    if spec.liger_kernel:
        loss = LossImpl.FUSED
        if spec.loss is None:
            notes.append("use_liger_kernel: Liger's fused linear cross-entropy, no logits")
    elif spec.loss is not None:
        loss = spec.loss
    elif spec.framework is Framework.HF:
        loss = LossImpl.HF
    else:
        loss = LossImpl.CHUNKED
        notes.append(f"{spec.framework} computes lm_head and cross-entropy in chunks")

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
