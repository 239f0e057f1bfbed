"""The job's choices: its methods, objectives, optimizers, attention and loss implementations
and frameworks, by the names the ecosystem gives them, and which options go with which."""

from __future__ import annotations

from enum import StrEnum

from service.core.errors import InvalidSpecError


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
# (service/core/spec/prompt.py); the weight-side ones are `DELTA_OPTIONS`.
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
